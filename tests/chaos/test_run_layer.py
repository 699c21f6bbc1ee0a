"""The run layer end to end on the fake target and the scripted load (tests/chaos/fakes.py):
Chaos Toolkit runs the experiment in this process, through the control, the probes, the
faults, the ledger and the report, with no stack, no Locust process and no network."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chaoslib.experiment import run_experiment

from conftest import REPO
from llmchaos import machine as machine_module
from llmchaos.load import LoadConfig
from llmchaos.report import RunResult
from llmchaos.run import ChaosRun
from llmchaos.runner import ExperimentOutcome, failure_message
from llmchaos.targets import register_kind
from tests.chaos.fakes import FakeKind, FakeTarget, ScriptedLoad

GPU_KILL = json.loads((REPO / "experiments" / "gpu_kill.json").read_text())
NODE_PARTITION = json.loads((REPO / "experiments" / "node_partition.json").read_text())


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The fake target registered and the scripted load in place; short windows: SLA 5 s,
    window 1 s, stable for 2 s, so a 3 s outage recovers in time and a 30 s one does not."""
    register_kind("fake", FakeKind())
    FakeKind.opened.clear()

    def scripted(config: LoadConfig) -> ScriptedLoad:
        return ScriptedLoad(config, FakeKind.opened[-1])

    monkeypatch.setattr(ChaosRun, "load_factory", staticmethod(scripted))
    env = {
        "LLMCHAOS_TARGET": "fake",
        "LLMCHAOS_RUNS_ROOT": str(tmp_path / "runs"),
        "LLMCHAOS_QPS": "20",
        "LLMCHAOS_SLA_S": "5",
        "LLMCHAOS_WINDOW_S": "1",
        "LLMCHAOS_STABLE_FOR_S": "2",
        "LLMCHAOS_WARMUP_S": "2",
        "LLMCHAOS_REQUEST_TIMEOUT_S": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield {"runs": tmp_path / "runs"}


def _run(
    experiment: dict[str, Any], runs: Path, **variables: str
) -> tuple[dict[str, Any], dict[str, Any], FakeTarget]:
    """Chaos Toolkit's run of `experiment` (`variables` as `--var`): journal, summary, target."""
    journal = run_experiment(copy.deepcopy(experiment), experiment_vars=(variables, {}))
    (run_dir,) = runs.glob("*")
    summary = json.loads((run_dir / "summary.json").read_text())
    return journal, summary, FakeKind.opened[-1]


def test_a_short_outage_recovers_within_the_sla(fake_run: dict[str, Any]) -> None:
    journal, summary, target = _run(GPU_KILL, fake_run["runs"])
    assert summary["verdict"] == "pass", summary["reasons"]
    assert journal["status"] == "completed" and not journal["deviated"]
    assert summary["score"]["percent"] == 100.0 and summary["score"]["total"] >= 4
    # 3 s of failures from the kill; recovered at the first stable run of 1 s windows
    assert 2.0 <= summary["recovery_time_s"] <= 4.5, summary["recovery_time_s"]
    assert summary["failed_requests"] >= 2 * 20  # at least two whole seconds of 20 QPS
    assert target.calls == [("kill_gpu_process", {"worker": "gpu-0"})]
    assert target.closed
    run_dir = Path(summary["run_dir"])
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    for name in ("report.html", "timeline.csv", "recovery.png", "journal.json", "ledger.jsonl"):
        assert (run_dir / name).exists(), name


def test_the_known_bad_variant_fails(fake_run: dict[str, Any]) -> None:
    journal, summary, _ = _run(GPU_KILL, fake_run["runs"], variant="no-failover")
    assert journal["deviated"]
    assert summary["verdict"] == "fail"
    assert summary["recovered"] is False or summary["recovery_time_s"] > 5
    # Chaos Toolkit stopped at the recovery probe; the control judged the rest for the score
    after = journal["steady_states"]["after"]
    names = [p["name"] for p in GPU_KILL["steady-state-hypothesis"]["probes"]]
    judged = after["probes"] + after["llmchaos_rest"]
    assert [r["activity"]["name"] for r in judged] == names
    assert len(after["probes"]) == 1 and after["steady_state_met"] is False
    # it gave up once the windows ruled out a recovery within the SLA, not at its deadline
    assert "at the soonest" in "".join(after["probes"][0]["exception"]), after["probes"][0]
    score = summary["score"]
    assert [s["name"] for s in score["slos"]] == names
    assert score["slos"][0] == {"name": names[0], "severity": "critical", "passed": False}
    total = sum(3 if s["severity"] == "critical" else 1 for s in score["slos"])
    assert score["total"] == total and score["points"] <= total - 3


def test_a_fault_that_cannot_be_injected_fails_the_verdict(
    fake_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMCHAOS_FAKE_FAIL_INJECTION", "true")
    journal, summary, _ = _run(GPU_KILL, fake_run["runs"])
    # Chaos Toolkit calls the run completed (and exits 0) after an action that raised; the
    # control says failed, so `chaos run` exits 1 with the verdict
    assert journal["status"] == "failed" and not journal["deviated"]
    saved = json.loads(Path(summary["run_dir"], "journal.json").read_text())
    assert saved["status"] == "failed"
    assert summary["verdict"] == "fail"
    assert any(
        r.startswith("fault not injected: kill-gpu-0-process failed") for r in summary["reasons"]
    )


def test_a_fault_that_did_nothing_fails_the_verdict(
    fake_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kill goes in without an error and changes nothing, so the SLO holds: only the
    check after the injection tells, and the verdict fails with its evidence."""
    monkeypatch.setenv("LLMCHAOS_FAKE_INEFFECTIVE", "true")
    journal, summary, target = _run(GPU_KILL, fake_run["runs"])
    assert journal["status"] == "failed" and not journal["deviated"]  # exit 1
    assert target.calls == [("kill_gpu_process", {"worker": "gpu-0"})]
    assert summary["verdict"] == "fail"
    assert summary["reasons"] == ["fault not in effect: kill_gpu_process(gpu-0): killed at None"], (
        summary["reasons"]
    )
    (fault,) = summary["faults"]
    assert fault["in_effect"] is False and fault["evidence"] == "killed at None"
    ledger = Path(summary["run_dir"], "ledger.jsonl").read_text()
    assert '"event": "verified"' in ledger and '"in_effect": false' in ledger


def test_a_fault_in_effect_keeps_its_evidence(fake_run: dict[str, Any]) -> None:
    _, summary, _ = _run(NODE_PARTITION, fake_run["runs"])
    (fault,) = summary["faults"]
    assert fault["in_effect"] is True
    assert fault["evidence"] == "partitioned: ['node-a']"
    assert not any(r.startswith("fault not in effect") for r in summary["reasons"])


def test_an_unhealthy_target_is_not_broken_further(
    fake_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMCHAOS_FAKE_UNHEALTHY_BEFORE", "true")
    journal, summary, target = _run(GPU_KILL, fake_run["runs"])
    assert journal["status"] == "interrupted"
    assert summary["reasons"][0].startswith("steady state not met before the method")
    assert target.calls == [], "no fault on a target that was unhealthy to begin with"


def test_without_rollbacks_the_ledger_heals_the_partition(fake_run: dict[str, Any]) -> None:
    experiment = copy.deepcopy(NODE_PARTITION)
    experiment["rollbacks"] = []
    _, summary, target = _run(experiment, fake_run["runs"])
    assert ("heal_partition", {"node": "node-a"}) in target.calls
    assert not target.partitioned
    assert [f["state"] for f in summary["faults"]] == ["undone"]


def test_a_failure_says_its_rate_and_the_machines_spare_cpu(
    fake_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # every machine counts as short of CPU here, so the run's note shows too
    monkeypatch.setattr(machine_module, "SHORT_OF_CPU_IDLE_CORES", 1e9)
    journal, summary, _ = _run(GPU_KILL, fake_run["runs"], variant="no-failover")
    machine = summary["machine"]
    assert machine["cores"] == len(os.sched_getaffinity(0))
    assert 0.0 <= machine["idle_cores"] <= machine["cores"]
    assert machine["span_s"] >= 2.0  # the warm-up at least
    assert any(n.startswith("this machine was short of CPU") for n in summary["notes"])
    run_dir = Path(summary["run_dir"])
    outcome = ExperimentOutcome(
        Path("gpu_kill.json"),
        "no-failover",
        1,
        journal,
        RunResult.read(run_dir / "summary.json"),
        run_dir,
        run_dir / "chaos.log",
        1.0,
    )
    assert (
        f"at 20 QPS, machine CPU: {machine['idle_cores']:.2f} of {machine['cores']} cores idle"
        in failure_message(outcome)
    )
