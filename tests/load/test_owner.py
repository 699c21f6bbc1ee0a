"""The owner watchdog and the LLMCHAOS_LOAD marker: a load whose owner died stops by itself,
and stray load processes can be found in /proc."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import signal_and_wait, sigterm_during_popen
from llmchaos import processes
from llmchaos.errors import InvalidInput
from llmchaos.ledger import FaultLedger
from llmchaos.load import LoadConfig, LoadRun
from llmchaos.load.api import check_config, find_load_processes
from llmchaos.load.procs import LOAD_ENV
from llmchaos.processes import Owner, group_members, start_ticks, stop_group
from llmchaos.run import ChaosRun
from llmchaos.settings import RunSettings


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# A leader that forks a child deaf to SIGTERM, as a Locust worker can be for a moment while it
# sends its last report: the leader's exit must not end the stop.
_LEADER_AND_DEAF_CHILD = """
import os, signal, time
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(60)
"""


def test_a_stopped_group_leaves_no_child_that_outlived_its_leader():
    leader = subprocess.Popen(
        [sys.executable, "-c", _LEADER_AND_DEAF_CHILD], start_new_session=True
    )
    try:
        assert _wait_for(lambda: len(group_members(leader.pid)) == 2, 10)
        stop_group(leader, grace_s=1.0)
        assert group_members(leader.pid) == []
        assert leader.returncode == -signal.SIGTERM
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_a_group_whose_leader_pid_was_handed_out_again_is_left_alone() -> None:
    """The leader ended and was reaped; its pid now belongs to a new process heading a group
    of its own (a `chaos run` in its own session): stopping the old group must not signal it.
    The reuse is staged: a Popen whose pid is the new process's, already reaped."""
    newcomer = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        reaped_leader = subprocess.Popen([sys.executable, "-c", "pass"])
        reaped_leader.wait()
        reaped_leader.pid = newcomer.pid  # the same number, handed out again
        stop_group(reaped_leader, grace_s=1.0)  # type: ignore[arg-type]
        assert newcomer.poll() is None, "the new process got the old group's signal"
    finally:
        newcomer.kill()
        newcomer.wait()


def test_stop_pids_spares_a_pid_that_changed_hands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the snapshot and the signal the process ended and its pid went to another:
    the start time no longer matches, so no signal goes out (staged through start_ticks)."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        real = processes.start_ticks
        calls: list[int] = []

        def ticks_that_change(pid: int) -> int | None:
            calls.append(pid)
            ticks = real(pid)
            return ticks if len(calls) == 1 or ticks is None else ticks + 1

        monkeypatch.setattr(processes, "start_ticks", ticks_that_change)
        assert processes.stop_pids([bystander.pid], grace_s=0.5) == [bystander.pid]
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_owner_is_gone_once_killed_even_before_it_is_reaped():
    child = subprocess.Popen(["sleep", "30"])
    try:
        owner = Owner.of(child.pid)
        assert owner.alive()
        child.kill()
        # Not reaped yet: a zombie is dead all the same.
        assert _wait_for(lambda: not owner.alive(), 5.0)
        assert start_ticks(child.pid) is None
    finally:
        child.kill()
        child.wait()
    assert not owner.alive()


def test_owner_whose_pid_was_reused_is_gone(monkeypatch):
    monkeypatch.setattr(processes, "start_ticks", lambda pid: 1000)
    owner = Owner.of(os.getpid())
    assert owner.alive()
    monkeypatch.setattr(processes, "start_ticks", lambda pid: 2000)  # another process, same pid
    assert not owner.alive()


@pytest.mark.parametrize(
    ("owner_pid", "message"),
    [
        (0, "owner_pid: expected a process id >= 1"),
        (True, "owner_pid: expected a process id >= 1"),
        (int(Path("/proc/sys/kernel/pid_max").read_text()) + 1, "owner_pid: no process"),
    ],
    ids=["zero", "bool", "no-such-process"],
)
def test_bad_owner_pid_is_invalid_input(owner_pid, message):
    config = LoadConfig(owner_pid=owner_pid, check_target=False)
    with pytest.raises(InvalidInput, match=message):
        check_config(config)


@pytest.mark.slow
def test_load_stops_itself_when_its_owner_is_killed(fake_server, tmp_path):
    server = fake_server()
    owner = subprocess.Popen(["sleep", "30"])
    run_dir = tmp_path / "run"
    config = LoadConfig(
        url=server.url,
        qps=50,
        duration_s=60.0,
        profile="constant",
        workers=2,
        run_dir=str(run_dir),
        drain_s=2.0,
        owner_pid=owner.pid,
    )
    try:
        with LoadRun.start(config) as run:
            start = run.wait_started()
            time.sleep(max(0.0, start + 1.5 - time.time()))
            ours = {pid for pid, d in find_load_processes().items() if d == str(run_dir.resolve())}
            assert run.status()["state"] == "running"
            owner.kill()
            owner.wait()
            killed = time.monotonic()
            summary = run.wait(timeout_s=15.0)
            took_s = time.monotonic() - killed
    finally:
        owner.kill()
        owner.wait()
    assert run.process.pid in ours and len(ours) == 3, ours  # the master and its 2 workers
    assert took_s < 8.0, took_s  # ~3 s: 1 s check, drain, final reports, summary, quit
    assert summary.accounting_closed and summary.ok == summary.scheduled
    assert 50 <= summary.scheduled < 50 * 10, summary.scheduled
    # rates over the seconds the load ran, not the planned 60 (issue 10: 0.65 QPS for 50)
    assert summary.stopped_early and 1.5 <= summary.ran_s < 10, summary.ran_s
    assert summary.achieved_qps == pytest.approx(50, rel=0.15), summary
    assert _wait_for(lambda: not ours & set(find_load_processes()), 5.0)
    assert "owner process" in (run_dir / "locust.log").read_text()


@pytest.mark.slow
def test_a_load_whose_folder_was_deleted_stops(fake_server, tmp_path):
    """`rm -rf reports/` under a live run: nothing can be written any more, so the load stops
    (it once hung on, idle, after the timeline write failed, even once its owner was gone)."""
    server = fake_server()
    owner = subprocess.Popen(["sleep", "60"])
    run_dir = tmp_path / "run"
    config = LoadConfig(
        url=server.url,
        qps=20,
        duration_s=60.0,
        profile="constant",
        run_dir=str(run_dir),
        drain_s=1.0,
        owner_pid=owner.pid,
    )
    try:
        with LoadRun.start(config) as run:
            run.wait_started()
            ours = {pid for pid, d in find_load_processes().items() if d == str(run_dir.resolve())}
            while run_dir.exists():  # the load may add a file while it is being deleted
                shutil.rmtree(run_dir, ignore_errors=True)
            assert ours and _wait_for(lambda: not ours & set(find_load_processes()), 10.0)
            assert owner.poll() is None  # it stopped because of the folder, not the owner
    finally:
        owner.kill()
        owner.wait()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_llmchaos_load_stops_cleanly_on_a_signal(fake_server, tmp_path, sig, busy_cores):
    """Ctrl-C or SIGTERM to `llmchaos load`: the load drains, the summary is printed, the
    accounting closes and no load process is left, with every core busy."""
    server = fake_server()
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "llmchaos.cli", "load", "--url", server.url, "--qps", "40"]
    argv += ["--duration", "120", "--profile", "constant", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: (run_dir / "timeline.jsonl").exists(), 60.0)
        time.sleep(2.0)
        out, err, took_s = signal_and_wait(proc, sig, 60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert took_s < 20, took_s
    summary = json.loads(out)
    assert summary["scheduled"] > 0 and summary["accounting_closed"], summary
    assert not [p for p, d in find_load_processes().items() if d == str(run_dir.resolve())]


def test_a_signal_held_while_the_load_process_starts_stops_that_process(tmp_path: Path) -> None:
    """SIGTERM during Popen is held (signals.deferred) and raised as the step ends: the load
    process exists by then, the caller never gets it, so LoadRun.start must stop it (seen with
    both cores busy: a run interrupted in starting-load left its load for the owner watchdog)."""
    run_dir = (tmp_path / "load").resolve()
    config = LoadConfig(
        url="http://127.0.0.1:9", qps=1, duration_s=5.0, run_dir=str(run_dir), check_target=False
    )
    with sigterm_during_popen("llmchaos.load.api.subprocess.Popen"):
        LoadRun.start(config)
    left = [pid for pid, d in find_load_processes().items() if d == str(run_dir)]
    for pid in left:  # a failing test does not leave them either (own session: pgid = pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    assert not left


def test_a_run_stops_load_processes_of_its_folder_that_no_handle_reaches(tmp_path: Path) -> None:
    """A load process marked with the run's load folder, whose handle the run never got (a
    start that failed half-way), is stopped when the run stops its load, not left to the
    owner watchdog."""
    run_dir = (tmp_path / "run").resolve()
    run_dir.mkdir()
    run = ChaosRun(RunSettings(), "x", "X", run_dir, FaultLedger(run_dir / "ledger.jsonl"))
    env = {**os.environ, LOAD_ENV: str(run_dir / "load")}
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, LOAD_ENV: str(tmp_path / "other-run" / "load")},
    )
    try:
        deadline = time.monotonic() + 10
        while stray.pid not in find_load_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.stop_load() is None
        assert stray.wait(timeout=10) is not None
        assert other.poll() is None  # another run's load is not this run's to stop
        assert any(str(stray.pid) in note for note in run.notes), run.notes
    finally:
        for process in (stray, other):
            process.kill()
            process.wait()
