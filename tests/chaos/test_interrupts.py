"""SIGINT or SIGTERM to `chaos run` during the fault, and kill -9 followed by `llmchaos
cleanup`: no partition rule, namespace or process of the run remains, and the stack is down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, chaos_run
from llmchaos.load.api import find_load_processes
from llmchaos.stack.cleanup import leftovers
from llmchaos.stack.netns import list_namespaces

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def _start(tmp_path: Path, rollbacks: bool = True) -> tuple[subprocess.Popen[str], Path]:
    experiment = json.loads((REPO / "experiments" / "node_partition.json").read_text())
    if not rollbacks:
        experiment["rollbacks"] = []
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment))
    runs = tmp_path / "runs"
    env = {
        **os.environ,
        "LLMCHAOS_RUNS_ROOT": str(runs),
        "LLMCHAOS_STACKS_ROOT": str(tmp_path / "stacks"),
        "LLMCHAOS_WARMUP_S": "3",
    }
    proc = subprocess.Popen(
        [
            str(BIN / "chaos"),
            "run",
            str(path),
            "--journal-path",
            str(tmp_path / "journal.json"),
        ],
        cwd=REPO,
        env=env,
        stdout=(tmp_path / "chaos.log").open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, runs


def _wait_for_fault(proc: subprocess.Popen[str], runs: Path, log: Path) -> Path:
    """The run folder, once its ledger says the partition is in place."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        for ledger in runs.glob("*/ledger.jsonl"):
            if '"event": "injected"' in ledger.read_text():
                return ledger.parent
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("no fault within 90 s:\n" + log.read_text()[-3000:])


def _assert_nothing_left(run_dir: Path) -> dict[str, object]:
    run = json.loads((run_dir / "run.json").read_text())
    stack_id = Path(run["stack_state_dir"]).name
    left = leftovers(stack_id)
    assert left.empty, left.summary()
    assert not [n for n in list_namespaces() if stack_id[-4:] in n]
    assert not [
        pid for pid, where in find_load_processes().items() if Path(where).is_relative_to(run_dir)
    ]
    topology = json.loads((Path(run["stack_state_dir"]) / "topology.json").read_text())
    assert topology["status"] == "stopped"
    return run


@pytest.mark.parametrize(
    ("sig", "rollbacks", "times"),
    [
        (signal.SIGINT, True, 1),
        (signal.SIGTERM, True, 1),
        (signal.SIGTERM, False, 1),
        (signal.SIGINT, False, 3),
    ],
    ids=["SIGINT", "SIGTERM", "SIGTERM-no-rollbacks", "SIGINT-x3-no-rollbacks"],
)
def test_a_signal_during_the_fault_undoes_and_stops_everything(
    tmp_path: Path, sig: signal.Signals, rollbacks: bool, times: int, needs_netns: None
) -> None:
    proc, runs = _start(tmp_path, rollbacks)
    log = tmp_path / "chaos.log"
    try:
        run_dir = _wait_for_fault(proc, runs, log)
        time.sleep(1.0)  # inside the recovery probe's wait
        for _ in range(times):  # an impatient user: the later ones land in the cleanup
            os.kill(proc.pid, sig)
            time.sleep(0.3)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert code == 1, output[-3000:]
    assert json.loads((tmp_path / "journal.json").read_text())["status"] == "interrupted"
    run = _assert_nothing_left(run_dir)
    assert run["status"] == "finished"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["verdict"] == "fail"
    assert summary["reasons"][0] == f"interrupted by {sig.name} during steady-state-after"
    # the rollback (strategy always) healed it, or else the control did from the ledger
    assert [f["state"] for f in summary["faults"]] == ["undone"]
    assert ("fault 1 partition_node(node-a): undone by control" in output) != rollbacks
    if times > 1:
        assert "received while undoing faults and stopping the run" in output


def test_kill_9_then_cleanup_leaves_nothing(tmp_path: Path, needs_netns: None) -> None:
    proc, runs = _start(tmp_path)
    log = tmp_path / "chaos.log"
    try:
        run_dir = _wait_for_fault(proc, runs, log)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == "running"
    assert list_namespaces(), "the killed run's partitioned node should still be there"
    result = subprocess.run(
        [
            str(BIN / "llmchaos"),
            "cleanup",
            "--runs-root",
            str(runs),
            "--state-root",
            str(tmp_path / "stacks"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"finished run {run_dir.name}" in result.stdout
    assert "partition_node(node-a)" in result.stdout
    run = _assert_nothing_left(run_dir)
    assert run["status"] == "abandoned"


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
