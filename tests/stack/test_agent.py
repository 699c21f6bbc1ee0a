"""The node agent as a real process: it forks its workers, restarts one that dies, and takes
them down with it. Every process started here is stopped by the test, also on failure."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llmchaos.processes import pid_alive
from llmchaos.stack.agent import AgentSettings, AgentWorker
from llmchaos.stack.procs import free_port, http_get_status
from llmchaos.stack.settings import GPU_PROFILE, WorkerSettings, write_settings
from llmchaos.stack.topology import AgentState, read_agent_state

DEADLINE_S = 20.0


def _wait_for(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {DEADLINE_S:g} s")
        time.sleep(0.05)


def _state(path: Path) -> AgentState:
    state = read_agent_state(path)
    assert state is not None, f"{path}: no agent state yet"
    return state


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, str]]:
    """An agent with worker gpu-0 (and bad-0, whose settings file does not exist); yields the
    agent, its state file and gpu-0's URL."""
    port = free_port()
    profile = dataclasses.replace(GPU_PROFILE, load_s=0.2)
    worker = WorkerSettings(name="gpu-0", node="node-t", port=port, profile=profile)
    url = f"http://127.0.0.1:{port}"
    workers = (
        AgentWorker(
            "gpu-0",
            str(write_settings(worker, tmp_path / "gpu-0.json")),
            str(tmp_path / "gpu-0.log"),
            health_url=f"{url}/healthz",
        ),
        AgentWorker("bad-0", str(tmp_path / "missing.json"), str(tmp_path / "bad-0.log")),
    )
    state_path = tmp_path / "agent-state.json"
    settings = AgentSettings("node-t", str(state_path), restart_delay_s=0.2, workers=workers)
    settings_path = write_settings(settings, tmp_path / "agent.json")
    with (tmp_path / "agent.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmchaos.stack.agent", "--settings", str(settings_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc, state_path, url
    finally:
        proc.kill()  # its workers die with it (PR_SET_PDEATHSIG)
        proc.wait()
        state = read_agent_state(state_path)
        pids = [w.pid for w in state.workers.values()] if state else []
        _wait_for("the workers gone with their agent", lambda: not any(map(pid_alive, pids)))


def test_a_forked_worker_serves_is_named_restarts_and_goes_with_its_agent(
    agent: tuple[subprocess.Popen[bytes], Path, str], tmp_path: Path
) -> None:
    proc, state_path, url = agent
    _wait_for("gpu-0 ready", lambda: http_get_status(f"{url}/healthz", 0.5) == 200)
    first = _state(state_path).workers["gpu-0"]
    assert Path(f"/proc/{first.pid}/comm").read_text().strip() == "gpu-0"
    assert f"worker[{first.pid}]" in (tmp_path / "gpu-0.log").read_text()
    assert "agent" not in (tmp_path / "gpu-0.log").read_text()

    # a worker that cannot start: its exit code is argparse's/settings' 2, and it says why
    _wait_for(
        "bad-0's exit noted",
        lambda: _state(state_path).workers["bad-0"].last_exit_code is not None,
    )
    assert _state(state_path).workers["bad-0"].last_exit_code == 2
    assert "llmchaos worker:" in (tmp_path / "bad-0.log").read_text()
    assert "started gpu-0" not in (tmp_path / "gpu-0.log").read_text()  # no agent lines

    os.kill(first.pid, signal.SIGKILL)
    _wait_for(
        "gpu-0 restarted",
        lambda: (
            _state(state_path).workers["gpu-0"].restarts == 1
            and _state(state_path).workers["gpu-0"].pid != first.pid
        ),
    )
    after = _state(state_path).workers["gpu-0"]
    assert after.last_exit_code == -signal.SIGKILL
    _wait_for("gpu-0 ready again", lambda: http_get_status(f"{url}/healthz", 0.5) == 200)

    proc.send_signal(signal.SIGTERM)  # a node going away: its workers stop, the agent exits 0
    assert proc.wait(timeout=DEADLINE_S) == 0
    assert not pid_alive(after.pid)
