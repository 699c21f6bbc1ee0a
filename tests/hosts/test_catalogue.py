"""The catalogue through `chaos run` against the hosts target's examples, real third-party
gateways in front of the simulated workers: the known-good configuration passes and the
known-bad variant fails, for reasons their documented behaviour explains.

- LiteLLM 1.108.7, gpu_kill: with the tuned router (retries, cooldown on the first failure,
  fallback) the killed worker's requests are retried on the other deployment: 0 failed. With
  `num_retries: 0` and `disable_cooldowns: true` (no-failover) every request that picks the dead,
  then loading (503), deployment fails until it serves again, 20 s after the kill.
- nginx 1.22, gateway_crash: the front door's `proxy_next_upstream ... non_idempotent` and
  `backup` gateway take the primary's requests; without the backup (no-backup-gateway) the
  front door answers 502 until the rollback restarts the primary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO
from llmchaos.runner import ExperimentOutcome, run_experiment
from tests.hosts.conftest import LITELLM_EXAMPLE, NGINX_EXAMPLE

pytestmark = pytest.mark.slow


def _run(experiment: str, hosts_file: Path, variant: str, tmp_path: Path) -> ExperimentOutcome:
    env = {
        "LLMCHAOS_TARGET": "hosts",
        "LLMCHAOS_HOSTS_FILE": str(hosts_file),
        "LLMCHAOS_HOSTS_STATE_ROOT": str(tmp_path / "hosts"),
    }
    return run_experiment(
        REPO / "experiments" / f"{experiment}.json",
        variant=variant,
        runs_root=tmp_path / "runs",
        extra_env=env,
        timeout_s=600,
    )


def test_gpu_kill_passes_through_litellm_with_the_tuned_router(
    tmp_path: Path, needs_litellm: None
) -> None:
    outcome = _run("gpu_kill", LITELLM_EXAMPLE, "hardened", tmp_path)
    result = outcome.result
    assert outcome.exit_code == 0 and result is not None, outcome.output_tail
    assert result.verdict == "pass" and result.failed_requests == 0, result.reasons
    assert result.qps_run == 8  # the hosts file's max_qps
    parts = result.target_recovery or {}
    assert [f["name"] for f in parts["recovered"] + parts["unrecovered"]] == ["gpu-0"]


def test_gpu_kill_fails_through_litellm_without_retries_and_cooldown(
    tmp_path: Path, needs_litellm: None
) -> None:
    outcome = _run("gpu_kill", LITELLM_EXAMPLE, "no-failover", tmp_path)
    result = outcome.result
    assert outcome.exit_code == 1 and result is not None, outcome.output_tail
    assert result.verdict.startswith("fail") and result.deviated
    assert result.recovered is False or (result.recovery_time_s or 0) > result.sla_s
    assert (result.failed_requests or 0) >= 20  # its share of 8 QPS for most of 20 s


def test_gateway_crash_passes_through_nginx_with_a_backup_gateway(
    tmp_path: Path, needs_nginx: None
) -> None:
    outcome = _run("gateway_crash", NGINX_EXAMPLE, "hardened", tmp_path)
    result = outcome.result
    assert outcome.exit_code == 0 and result is not None, outcome.output_tail
    assert result.verdict == "pass" and result.failed_requests == 0, result.reasons


def test_gateway_crash_fails_through_nginx_without_a_backup_gateway(
    tmp_path: Path, needs_nginx: None
) -> None:
    outcome = _run("gateway_crash", NGINX_EXAMPLE, "no-backup-gateway", tmp_path)
    result = outcome.result
    assert outcome.exit_code == 1 and result is not None, outcome.output_tail
    assert result.deviated and (result.failed_requests or 0) > 0
