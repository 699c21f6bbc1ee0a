"""SIGINT or SIGTERM to `chaos run` in every phase, kill -9 followed by `llmchaos cleanup`,
two runs at once: no partition rule, namespace or process of a run remains, its stack is
down, and nothing of another run is touched."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, chaos_run, interrupt_cases, repeat_count, stop_gracefully
from llmchaos import control
from llmchaos.load.api import find_load_processes
from llmchaos.stack.cleanup import leftovers
from llmchaos.stack.netns import list_namespaces

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


PHASES = (
    "starting-target",
    "starting-load",
    "warming-up",
    "steady-state-before",
    "method",
    "steady-state-after",
    "rollbacks",
    "report",
)
"""The phases a run goes through (run.json `phase`), in order; the finish's own phases
(undoing-faults, stopping-load, report, stopping-target) hold signals off."""
FAST_ENV = {"LLMCHAOS_WARMUP_S": "3", "LLMCHAOS_WINDOW_S": "2", "LLMCHAOS_STABLE_FOR_S": "3"}
"""Short phases: the point is where the signal lands, not the verdict."""


def _experiment(tmp_path: Path, rollbacks: bool = True, pause_s: float = 2) -> Path:
    """node_partition, with pauses (2 s) after the fault and the heal so that a signal can
    land in the method and in the rollbacks."""
    experiment = json.loads((REPO / "experiments" / "node_partition.json").read_text())
    experiment["method"][0]["pauses"] = {"after": pause_s}
    experiment["rollbacks"][0]["pauses"] = {"after": 2}
    if not rollbacks:
        experiment["rollbacks"] = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment))
    return path


def _start(
    tmp_path: Path,
    rollbacks: bool = True,
    *,
    runs: Path | None = None,
    name: str = "chaos",
    pause_s: float = 2,
) -> tuple[subprocess.Popen[str], Path]:
    runs = runs or tmp_path / "runs"
    env = {
        **os.environ,
        **FAST_ENV,
        "LLMCHAOS_RUNS_ROOT": str(runs),
        "LLMCHAOS_STACKS_ROOT": str(tmp_path / "stacks"),
    }
    experiment = _experiment(tmp_path / name, rollbacks, pause_s)
    argv = [str(BIN / "chaos"), "run", str(experiment)]
    proc = subprocess.Popen(
        [*argv, "--journal-path", str(tmp_path / f"{name}-journal.json")],
        cwd=REPO,
        env=env,
        stdout=(tmp_path / f"{name}.log").open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, runs


def _wait_for_phase(
    proc: subprocess.Popen[str], runs: Path, log: Path, phase: str, timeout_s: float = 120
) -> Path:
    """The run folder, the moment its run.json says `phase` (or a later one)."""
    wanted = PHASES.index(phase)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        for run_file in runs.glob("*/run.json"):
            with contextlib.suppress(OSError, ValueError):
                now = json.loads(run_file.read_text()).get("phase")
                if now in PHASES and PHASES.index(now) >= wanted:
                    return run_file.parent
        time.sleep(0.01)
    stop_gracefully(proc)
    raise AssertionError(f"no phase {phase} within {timeout_s} s:\n" + log.read_text()[-3000:])


def _wait_for_fault(
    proc: subprocess.Popen[str], runs: Path, log: Path, other: Path | None = None
) -> Path:
    """The run folder (not `other`'s), once its ledger says the partition is in place."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        for ledger in runs.glob("*/ledger.jsonl"):
            if ledger.parent != other and '"event": "injected"' in ledger.read_text():
                return ledger.parent
        time.sleep(0.2)
    stop_gracefully(proc)
    raise AssertionError("no fault within 90 s:\n" + log.read_text()[-3000:])


def _assert_nothing_left(run_dir: Path) -> dict[str, object]:
    """Nothing of the run's stacks (every one under its stacks root) or of its load."""
    run = json.loads((run_dir / "run.json").read_text())
    stacks = [p for p in (run_dir.parent.parent / "stacks").glob("*") if p.is_dir()]
    for stack in stacks:
        left = leftovers(stack.name)
        assert left.empty, left.summary()
        assert not [n for n in list_namespaces() if stack.name[-4:] in n]
        topology = stack / "topology.json"
        assert not topology.exists() or json.loads(topology.read_text())["status"] == "stopped"
    assert not [
        pid for pid, where in find_load_processes().items() if Path(where).is_relative_to(run_dir)
    ]
    return run


def _interrupt_at(tmp_path: Path, sig: signal.Signals, phase: str) -> None:
    proc, runs = _start(tmp_path)
    log = tmp_path / "chaos.log"
    try:
        run_dir = _wait_for_phase(proc, runs, log, phase)
        os.kill(proc.pid, sig)
        sent = time.monotonic()
        code = proc.wait(timeout=120)
        took_s = time.monotonic() - sent
    finally:
        stop_gracefully(proc)
    output = log.read_text()
    assert took_s < 60, f"{sig.name} in {phase} took {took_s:.0f} s to honour"
    run = _assert_nothing_left(run_dir)
    assert run["status"] == "finished", output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [f["state"] for f in summary["faults"]] in ([], ["undone"])
    if phase == "report":  # the run was finishing: held off, it ends as it would have
        assert f"{sig.name} received while undoing faults and stopping the run" in output
        return
    assert code == 1, output[-3000:]
    assert json.loads((tmp_path / "chaos-journal.json").read_text())["status"] == "interrupted"
    reason = summary["reasons"][0]
    assert reason.startswith(f"interrupted by {sig.name} during "), summary["reasons"]
    landed = reason.rsplit(" ", 1)[1]
    assert PHASES.index(landed) >= PHASES.index(phase), (landed, phase)


@pytest.mark.parametrize(("sig", "phase"), interrupt_cases(PHASES))
def test_a_signal_in_any_phase_stops_the_run_and_everything_it_started(
    tmp_path: Path, sig: signal.Signals, phase: str, busy_cores: None, needs_netns: None
) -> None:
    """With every core busy: the run ends within a minute, no process, namespace or load of
    it is left, its report says in which phase it was interrupted."""
    for attempt in range(repeat_count()):
        _interrupt_at(tmp_path / f"attempt-{attempt}", sig, phase)


@pytest.mark.parametrize(
    ("sig", "times"),
    [(signal.SIGTERM, 1), (signal.SIGINT, 3)],
    ids=["SIGTERM-no-rollbacks", "SIGINT-x3-no-rollbacks"],
)
def test_without_rollbacks_the_ledger_undoes_the_fault(
    tmp_path: Path, sig: signal.Signals, times: int, needs_netns: None
) -> None:
    """No rollbacks in the experiment: the control heals the partition from the ledger. An
    impatient user's later signals land in the cleanup and are held off."""
    proc, runs = _start(tmp_path, rollbacks=False)
    log = tmp_path / "chaos.log"
    try:
        run_dir = _wait_for_fault(proc, runs, log)
        for _ in range(times):
            os.kill(proc.pid, sig)
            time.sleep(0.3)
        code = proc.wait(timeout=90)
    finally:
        stop_gracefully(proc)
    output = log.read_text()
    assert code == 1, output[-3000:]
    run = _assert_nothing_left(run_dir)
    assert run["status"] == "finished"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["verdict"] == "fail"
    assert [f["state"] for f in summary["faults"]] == ["undone"]
    assert "fault 1 partition_node(node-a): undone by control" in output
    if times > 1:
        assert "received while undoing faults and stopping the run" in output


def _cleanup(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    roots = ["--runs-root", str(tmp_path / "runs"), "--state-root", str(tmp_path / "stacks")]
    result = subprocess.run(
        [str(BIN / "llmchaos"), "cleanup", *roots],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result


def _kill_9_at(
    proc: subprocess.Popen[str], runs: Path, log: Path, phase: str | None, other: Path | None = None
) -> Path:
    """SIGKILL the run once its fault is in (phase None) or once it reaches `phase`."""
    try:
        if phase is None:
            run_dir = _wait_for_fault(proc, runs, log, other)
        else:
            run_dir = _wait_for_phase(proc, runs, log, phase)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        stop_gracefully(proc)
    return run_dir


@pytest.mark.solo  # a machine-wide cleanup: see tests/conftest.py
def test_kill_9_then_cleanup_leaves_nothing(tmp_path: Path, needs_netns: None) -> None:
    proc, runs = _start(tmp_path)
    run_dir = _kill_9_at(proc, runs, tmp_path / "chaos.log", None)
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == "running"
    assert list_namespaces(), "the killed run's partitioned node should still be there"
    result = _cleanup(tmp_path)
    assert f"finished run {run_dir.name}" in result.stdout
    assert "partition_node(node-a)" in result.stdout
    run = _assert_nothing_left(run_dir)
    assert run["status"] == "abandoned"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rebuilt"] == "rebuilt after the run was killed at method"
    assert summary["verdict"] == "fail"  # no journal: the experiment never ended
    assert [f["state"] for f in summary["faults"]] == ["undone"]


@pytest.mark.solo  # a machine-wide cleanup: see tests/conftest.py
def test_kill_9_during_the_report_then_cleanup_rebuilds_it(
    tmp_path: Path, needs_netns: None
) -> None:
    """The whole experiment ran; the process died while writing its report. Cleanup writes
    the report from the run folder, with the recovery time the run would have printed (the
    recovery probe's, from the journal saved before the finish) and the faults' final state."""
    proc, runs = _start(tmp_path)
    run_dir = _kill_9_at(proc, runs, tmp_path / "chaos.log", "report")
    journal = json.loads((run_dir / "journal.json").read_text())
    (probed,) = [
        p["output"]
        for p in journal["steady_states"]["after"]["probes"]
        if p["activity"]["provider"]["func"] == "recovery_time_s"
    ]
    (run_dir / "summary.json").unlink(missing_ok=True)  # as if the kill came before it
    (run_dir / "report.html").unlink(missing_ok=True)
    result = _cleanup(tmp_path)
    assert "report rebuilt after the run was killed at report" in result.stdout, result.stdout
    _assert_nothing_left(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rebuilt"] == "rebuilt after the run was killed at report"
    assert summary["recovery_time_s"] == probed and summary["recovery_time_source"] == "probe"
    assert summary["verdict"] == "pass", summary["reasons"]
    assert [f["state"] for f in summary["faults"]] == ["undone"]  # by the rollback
    assert summary["load"]["scheduled"] > 0
    assert "rebuilt after the run was killed at report" in (run_dir / "report.html").read_text()


@pytest.mark.solo  # a machine-wide cleanup: see tests/conftest.py
def test_cleanup_after_a_kill_9_leaves_a_live_run_untouched(
    tmp_path: Path, needs_netns: None
) -> None:
    """Two runs at once under the same roots; one is killed with SIGKILL and cleaned up
    while the other is in its steady state. The other goes on and passes."""
    # surely live at the cleanup: the doomed run reaches its fault and is cleaned up in about
    # 10 s (9 s for test_kill_9_then_cleanup_leaves_nothing's whole run)
    live, runs = _start(tmp_path, name="live", pause_s=20)
    try:
        live_dir = _wait_for_phase(live, runs, tmp_path / "live.log", "warming-up")
        doomed, _ = _start(tmp_path, name="doomed")
        doomed_dir = _kill_9_at(doomed, runs, tmp_path / "doomed.log", None, other=live_dir)
        result = _cleanup(tmp_path)
        code = live.wait(timeout=180)
    finally:
        if live.poll() is None:
            live.kill()
    live_stack = Path(
        json.loads((live_dir / "run.json").read_text())["target_record"]["stack_state_dir"]
    ).name
    assert f"finished run {doomed_dir.name}" in result.stdout
    assert f"left alone stack {live_stack}" in result.stdout, result.stdout
    assert "belongs to a live chaos run" in result.stdout
    assert live_dir.name not in result.stdout.split("left alone")[0]
    assert code == 0, (tmp_path / "live.log").read_text()[-3000:]
    summary = json.loads((live_dir / "summary.json").read_text())
    assert summary["verdict"] == "pass", summary["reasons"]
    assert json.loads((doomed_dir / "run.json").read_text())["status"] == "abandoned"
    _assert_nothing_left(live_dir)


def test_the_safety_guard_undoes_and_aborts_a_run_that_keeps_failing(tmp_path: Path) -> None:
    """No backup gateway and the primary crashed: every request fails. The guard (here after
    4 s above 50%) restores the gateway and stops the run before the recovery probe's wait."""
    env = {
        "LLMCHAOS_RUNS_ROOT": str(tmp_path / "runs"),
        "LLMCHAOS_STACKS_ROOT": str(tmp_path / "stacks"),
        "LLMCHAOS_WARMUP_S": "3",
        "LLMCHAOS_GUARD_FOR_S": "4",
        "LLMCHAOS_NETNS": "off",
    }
    experiment = REPO / "experiments" / "gateway_crash.json"
    done = chaos_run(
        experiment, tmp_path / "journal.json", "--var", "variant=no-backup-gateway", env=env
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "safety guard: error rate above 50% for 4 s" in output
    (run_dir,) = (tmp_path / "runs").glob("*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["guard"] and summary["guard"].startswith("error rate above 50% for 4 s")
    assert summary["verdict"] == "fail" and summary["journal_status"] == "interrupted"
    (fault,) = summary["faults"]
    assert fault["state"] == "undone"
    ledger = (run_dir / "ledger.jsonl").read_text()
    assert '"by": "guard"' in ledger
    assert json.loads((tmp_path / "journal.json").read_text())["status"] == "interrupted"
    _assert_nothing_left(run_dir)


class _SignalledWhileFinalized:
    """Gets the control's SIGTERM handler called inside its `__del__`, as a signal arriving
    while Python runs a finalizer (a temporary file's closer, seen in `starting-load`)."""

    def __del__(self) -> None:
        control._interrupt(signal.SIGTERM, None)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_lost_in_a_finalizer_is_raised_again_at_the_next_step() -> None:
    """Python prints and drops an exception raised in `__del__`: the control must not let the
    run go on as if no signal had come."""
    run = SimpleNamespace(phase="starting-load", interrupted_because=None)
    run.enter_phase = lambda phase: setattr(run, "phase", phase)
    control._session = control._Session()
    control._session.run = run  # type: ignore[assignment]
    try:
        _SignalledWhileFinalized()  # collected at once: its KeyboardInterrupt is dropped
        assert run.interrupted_because == "interrupted by SIGTERM during starting-load"
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            control.before_hypothesis_control({})
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            control.before_method_control({})
    finally:
        control._restore_signals()
        control._session = None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("phase", ["steady-state-after", "rollbacks"])
def test_an_interrupt_lost_after_the_method_still_ends_the_run_interrupted(phase: str) -> None:
    """Lost in a finalizer where nothing raises it again (the rest of steady-state-after and
    the rollbacks run on), the signal still makes the journal `interrupted` (exit 1), not a
    pass; a run without a signal stays `completed`."""
    for signalled in (True, False):
        control._session = control._Session()
        journal: dict[str, object] = {"status": "completed"}
        try:
            if signalled:
                run = SimpleNamespace(phase=phase, interrupted_because=None)
                control._session.run = run  # type: ignore[assignment]
                _SignalledWhileFinalized()
                assert run.interrupted_because == f"interrupted by SIGTERM during {phase}"
                control._session.run = None
            control._finish(journal)
        finally:
            control._restore_signals()
            control._session = None
        assert journal["status"] == ("interrupted" if signalled else "completed")
