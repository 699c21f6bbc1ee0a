"""The test harness itself: `make test` runs tests/ on pytest-xdist workers, and an interrupted
run must still stop what its tests started."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import REPO
from llmchaos.processes import pid_alive

_SLEEPER_TEST = """
import subprocess, sys, time
import pytest

@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open({pid_file!r}, "w") as f:
        f.write(str(proc.pid))
    yield
    time.sleep({teardown_s})  # a chaos run's teardown: undo faults, stop the load and stack
    proc.kill()
    proc.wait()

def test_waits(child):
    time.sleep(120)
"""


TEARDOWN_S = 12
"""The sleeper's teardown: longer than xdist's own wait for a worker (10 s)."""


def test_a_sigterm_to_the_xdist_controller_alone_stops_the_workers_tests(
    tmp_path: Path, busy_cores: None
) -> None:
    """SIGTERM sent to the controller alone (a CI runner cancelling the job, `kill`) reaches
    the workers' tests, and their fixtures get the time to stop what they started: xdist's
    own shutdown (execnet's 5 s, then SIGINT, then 10 s, then exit) left the child running.
    SIGINT takes the same path in the controller."""
    pid_file = tmp_path / "child.pid"
    test_file = tmp_path / "test_sleeper.py"
    test_file.write_text(
        textwrap.dedent(_SLEEPER_TEST.format(pid_file=str(pid_file), teardown_s=TEARDOWN_S))
    )
    controller = subprocess.Popen(
        [sys.executable, "-m", "pytest", str(test_file), "-n", "1", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    child_pid = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert controller.poll() is None, controller.communicate()[0]
            assert time.monotonic() < deadline, "the worker's test never started its child"
            time.sleep(0.1)
        child_pid = int(pid_file.read_text())
        controller.send_signal(signal.SIGTERM)
        output = controller.communicate(timeout=TEARDOWN_S + 60)[0]
        assert controller.returncode == 2, output  # interrupted
        assert not pid_alive(child_pid), f"the test's child {child_pid} outlived the run"
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()
        if child_pid is not None and pid_alive(child_pid):
            subprocess.run(["kill", "-9", str(child_pid)], check=False)
