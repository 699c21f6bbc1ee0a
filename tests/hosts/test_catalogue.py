"""The catalogue through `chaos run` against the hosts target's examples, real third-party
gateways in front of the simulated workers: the known-good configuration passes and the
known-bad variant fails, for reasons their documented behaviour explains.

- LiteLLM 1.108.7, gpu_kill: with the tuned router (retries, cooldown on the first failure,
  fallback) the killed worker's requests are retried on the other deployment: 0 failed. With
  `num_retries: 0` and `disable_cooldowns: true` (no-failover) every request that picks the dead,
  then loading (503), deployment fails until it serves again, 20 s after the kill.
- LiteLLM 1.108.7, cpu_throttle (gpu-0 at 0.5% of a CPU): with `latency-based-routing` (the
  tuned settings otherwise) the slowed deployment got none of the requests after the
  throttle; the tuned settings route with `simple-shuffle`, which ignores latency: 38-50%, so
  the run fails on the share probe.
- nginx 1.22, gateway_crash: the front door's `proxy_next_upstream ... non_idempotent` and
  `backup` gateway take the primary's requests; without the backup (no-backup-gateway) the
  front door answers 502 until the rollback restarts the primary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, ci_run_env
from llmchaos.runner import ExperimentOutcome, run_experiment
from tests.hosts.conftest import LITELLM_EXAMPLE, NGINX_EXAMPLE

pytestmark = pytest.mark.slow


# The cpu_throttle cases run alone (`solo`): how LiteLLM routes around a slowed deployment
# depends on how slow it gets. Beside the other tests (4 xdist workers) the shuffle variant
# passed once, gpu-0's share under 30%, where it had 38-50% with two busy loops beside it:
# the run's files were lost. Alone in CI (2026-12-07) it passed with a share of 0: gpu-0's
# counters missed the read after the window, which counted as 0 requests (since fixed in
# measure.worker_share_after_fault); the first pass may have been the same.
#
# 1% of a CPU (1 ms per 100 ms) barely slows a worker taking half of LiteLLM's 8 QPS: its
# median answer stayed as fast, and latency-based routing sent it 0-40% of the requests from
# run to run (README, "The hosts target"). At 0.5% (1 ms per 200 ms) it falls behind.
HOSTS_CPU_PERCENT = "0.5"


def _run(experiment: str, hosts_file: Path, variant: str, tmp_path: Path) -> ExperimentOutcome:
    env = {
        **ci_run_env(),  # the suite's shorter phases: solo, the cpu_throttle pair took 112 s
        "LLMCHAOS_TARGET": "hosts",
        "LLMCHAOS_HOSTS_FILE": str(hosts_file),
        "LLMCHAOS_HOSTS_STATE_ROOT": str(tmp_path / "hosts"),
        "LLMCHAOS_CPU_PERCENT": HOSTS_CPU_PERCENT,
    }
    return run_experiment(
        REPO / "experiments" / f"{experiment}.json",
        variant=variant,
        runs_root=tmp_path / "runs",
        extra_env=env,
        timeout_s=600,
    )


CASES = [
    pytest.param("gpu_kill", LITELLM_EXAMPLE, "hardened", True, id="litellm-gpu_kill-tuned"),
    pytest.param(
        "gpu_kill", LITELLM_EXAMPLE, "no-failover", False, id="litellm-gpu_kill-no-failover"
    ),
    pytest.param(
        "cpu_throttle",
        LITELLM_EXAMPLE,
        "latency-routing",
        True,
        id="litellm-cpu_throttle-latency",
        marks=pytest.mark.solo,
    ),
    pytest.param(
        "cpu_throttle",
        LITELLM_EXAMPLE,
        "hardened",
        False,
        id="litellm-cpu_throttle-shuffle",
        marks=pytest.mark.solo,
    ),
    pytest.param("gateway_crash", NGINX_EXAMPLE, "hardened", True, id="nginx-gateway_crash-backup"),
    pytest.param(
        "gateway_crash",
        NGINX_EXAMPLE,
        "no-backup-gateway",
        False,
        id="nginx-gateway_crash-no-backup",
    ),
]


@pytest.mark.parametrize(("experiment", "hosts_file", "variant", "passes"), CASES)
def test_known_good_passes_and_known_bad_fails(
    experiment: str,
    hosts_file: Path,
    variant: str,
    passes: bool,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    request.getfixturevalue("needs_litellm" if hosts_file == LITELLM_EXAMPLE else "needs_nginx")
    outcome = _run(experiment, hosts_file, variant, tmp_path)
    result = outcome.result
    assert result is not None, outcome.output_tail
    if passes:
        assert outcome.exit_code == 0 and result.verdict == "pass", result.reasons
        # at most what was in flight at the fault: the rate (LiteLLM's file 8 QPS, nginx's 20)
        # times the answers' latency; 3 once on a slow box beside 5 other xdist workers (the
        # known-bad gpu_kill and gateway_crash variants fail 20 and more)
        assert (result.failed_requests or 0) <= 4
    elif experiment == "cpu_throttle":  # the throttled worker keeps its share
        # no bound on failures: 0 in three runs at 0.5%, but LiteLLM retries what the slowed
        # worker times out and 3 failed at 0.2%; the share is what this variant gets wrong
        assert outcome.exit_code == 1 and result.deviated, result.reasons
        # the share probe fails; it is not always the first deviation (once recovery was)
        unmet = [slo["name"] for slo in result.score["slos"] if not slo["passed"]]
        assert "gpu-0-gets-at-most-30-percent" in unmet, (unmet, result.reasons)
    else:
        assert outcome.exit_code == 1 and result.deviated, result.reasons
        assert result.recovered is False or (result.recovery_time_s or 0) > result.sla_s
        assert (result.failed_requests or 0) >= 20  # seconds of its share of the load
    if hosts_file == LITELLM_EXAMPLE:
        assert result.qps_run == 8  # the hosts file's max_qps, not the experiment's 5000
    if experiment == "gpu_kill":
        parts = result.target_recovery or {}
        assert [f["name"] for f in parts["recovered"] + parts["unrecovered"]] == ["gpu-0"]
