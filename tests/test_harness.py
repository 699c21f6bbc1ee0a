"""The test harness itself: `make test` runs tests/ on pytest-xdist workers, and an interrupted
run must still stop what its tests started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO
from llmchaos.processes import pid_alive

_SLEEPER_TEST = """
import subprocess, sys, time
import pytest

@pytest.fixture
def child():
    # deaf to SIGINT: a Ctrl-C to the whole process group must not end it, the teardown must
    proc = subprocess.Popen([sys.executable, "-c", {child!r}])
    with open({pid_file!r}, "w") as f:
        f.write(str(proc.pid))
    yield
    time.sleep({teardown_s})  # a chaos run's teardown: undo faults, stop the load and stack
    proc.kill()
    proc.wait()

def test_waits(child):
    time.sleep(120)
"""


_STACKS_CONFTEST = """
import faulthandler, os, signal
_stacks = open(os.path.join(os.path.dirname(__file__), f"stacks-{os.getpid()}.txt"), "w")
faulthandler.register(signal.SIGUSR2, file=_stacks, all_threads=True)
"""
"""Loaded by the controller and its worker both (the test file's own conftest): SIGUSR2 writes
every thread's stack to stacks-<pid>.txt beside it, to see where a run that does not stop
hangs (to a file: pytest has stderr captured when it loads a conftest)."""


TEARDOWN_S = 12
"""The sleeper's teardown: longer than xdist's own wait for a worker (10 s)."""


_CHILD = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)"


@pytest.mark.parametrize("to_group", [False, True], ids=["controller-alone", "ctrl-c-to-all"])
def test_an_interrupted_xdist_run_lets_its_tests_stop_what_they_started(
    tmp_path: Path, to_group: bool, busy_cores: None
) -> None:
    """SIGTERM sent to the controller alone (a CI runner cancelling the job, `kill`) reaches
    the workers' tests, and their fixtures get the time to stop what they started: xdist's
    own shutdown SIGKILLed the worker after 10 s, mid-teardown, and left the child running.
    A Ctrl-C (SIGINT to the controller and the worker both) does the same: the controller's
    SIGTERM that follows must not interrupt the teardown the SIGINT started."""
    pid_file = tmp_path / "child.pid"
    test_file = tmp_path / "test_sleeper.py"
    (tmp_path / "conftest.py").write_text(_STACKS_CONFTEST)
    test_file.write_text(
        textwrap.dedent(
            _SLEEPER_TEST.format(pid_file=str(pid_file), teardown_s=TEARDOWN_S, child=_CHILD)
        )
    )
    controller = subprocess.Popen(
        # with `make test`'s flags
        [
            sys.executable,
            "-m",
            "pytest",
            str(test_file),
            "-n",
            "1",
            "--max-worker-restart=0",
            "-qp",
            "no:cacheprovider",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # on failure the whole run goes: controller, worker, child
    )
    child_pid = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert controller.poll() is None, controller.communicate()[0]
            assert time.monotonic() < deadline, "the worker's test never started its child"
            time.sleep(0.1)
        child_pid = int(pid_file.read_text())
        if to_group:
            os.killpg(controller.pid, signal.SIGINT)
        else:
            controller.send_signal(signal.SIGTERM)
        try:
            output = controller.communicate(timeout=TEARDOWN_S + 60)[0]
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # the stacks of controller and worker
                os.killpg(controller.pid, signal.SIGUSR2)
                time.sleep(2.0)
            os.killpg(controller.pid, signal.SIGKILL)
            output = controller.communicate()[0][-2000:]
            for stacks in sorted(tmp_path.glob("stacks-*.txt")):
                output += f"\n{stacks.name}:\n{stacks.read_text()[-4000:]}"
            raise AssertionError(f"the run did not stop:\n{output}") from None
        assert controller.returncode == 2, output  # interrupted
        assert not pid_alive(child_pid), f"the test's child {child_pid} outlived the run"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(controller.pid, signal.SIGKILL)
        controller.wait()
        if child_pid is not None and pid_alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)
