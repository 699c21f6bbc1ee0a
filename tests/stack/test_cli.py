"""`llmchaos stack ...` and `llmchaos cleanup` from the command line, bad input included."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import interrupt_cases, repeat_count, signal_and_wait, stop_gracefully
from llmchaos.cli import main
from llmchaos.stack.cleanup import leftovers


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmchaos.cli", *args], capture_output=True, text=True, timeout=120
    )


def one_line_error(capsys: pytest.CaptureFixture[str], *expected: str) -> None:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for text in expected:
        assert text in err


def test_unknown_variant_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["stack", "up", "--variant", "bogus", "--state-root", str(tmp_path)]) == 2
    one_line_error(capsys, "unknown variant 'bogus'", "naive-cache", "no-cpu-fallback")
    assert not list(tmp_path.iterdir()), "nothing may be started or written for bad input"


def test_port_in_use_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["stack", "up", "--port", str(port), "--state-root", str(tmp_path)]) == 2
    one_line_error(capsys, f"--port {port}", "in use")


def test_netns_on_without_root_is_one_line_and_exit_2(tmp_path: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["stack", "up", "--netns", "on", "--state-root", str(tmp_path)]) == 2
    one_line_error(capsys, "--netns on", "root")


def test_missing_redis_server_is_one_line_and_exit_2(tmp_path: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["stack", "up", "--state-root", str(tmp_path)]) == 2
    one_line_error(capsys, "redis-server not found", "apt-get install redis-server")


def test_bad_worker_count_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["stack", "up", "--gpu-workers", "-1", "--state-root", str(tmp_path)]) == 2
    one_line_error(capsys, "gpu_workers", ">= 0")


def test_a_bad_stack_knob_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["stack", "up", "--gpu-max-num-seqs", "0", "--state-root", str(tmp_path)]
    assert main(argv) == 2
    one_line_error(capsys, "gpu_max_num_seqs", "1..4096", "got 0")
    assert not list(tmp_path.iterdir()), "nothing may be started or written for bad input"


def test_status_without_a_stack_says_how_to_start_one(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["stack", "status", "--state-root", str(tmp_path)]) == 2
    one_line_error(capsys, "no stack found", "llmchaos stack up")


@pytest.mark.solo  # a machine-wide cleanup: see tests/conftest.py
@pytest.mark.slow
def test_up_status_down_from_the_command_line(tmp_path: Path) -> None:
    root = str(tmp_path)
    up = run_cli(
        "stack", "up", "--port", "0", "--gpu-load-s", "0.5", "--state-root", root,
        "--gpu-max-num-seqs", "16", "--degradation-queue-threshold", "40",
        "--queue-shed-threshold", "80",
    )  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr
        topology_path = Path(up.stdout.strip().splitlines()[-1])
        assert topology_path.name == "topology.json" and topology_path.exists()
        # the knobs reach the parts that use them
        gateway = json.loads((topology_path.parent / "gateway-primary.json").read_text())
        assert gateway["degradation"]["queue_depth_threshold"] == 40
        assert gateway["queue_shed_threshold"] == 80
        gpu = json.loads((topology_path.parent / "worker-gpu-0.json").read_text())
        assert gpu["profile"]["max_num_seqs"] == 16
        assert "haproxy ready" in up.stderr, "stack up shows progress"
        status = run_cli("stack", "status", "--json", "--state-root", root)
        assert status.returncode == 0, status.stderr
        data = json.loads(status.stdout)
        assert data["haproxy_alive"] and data["redis_alive"]
        workers = [w for n in data["nodes"] for w in n["workers"]]
        assert {w["name"]: w["healthz"] for w in workers} == {
            "gpu-0": 200,
            "gpu-1": 200,
            "cpu-0": 200,
        }
        assert all(isinstance(w["pid"], int) for w in workers)
        text = run_cli("stack", "status", "--state-root", root)
        assert "gateway-primary" in text.stdout and "cpu-0" in text.stdout
    finally:
        down = run_cli("stack", "down", "--state-root", root)
    assert down.returncode == 0, down.stderr
    assert leftovers(data["stack_id"]).empty
    again = run_cli("cleanup", "--state-root", root)
    assert again.returncode == 0 and data["stack_id"] not in again.stdout, again.stdout


STACK_UP_PHASES = ("redis-server ready", "token table seeded", "workers ready", "gateways ready")
"""Progress lines of `stack up`; the signal is sent the moment one is printed."""


def _interrupt_stack_up(
    state_root: Path, sig: signal.Signals, after: str, *, inherit_ignored: bool = False
) -> None:
    argv = [sys.executable, "-m", "llmchaos.cli", "stack", "up", "--port", "0"]

    def ignore_sigint() -> None:  # what a non-interactive shell's `cmd &` hands down
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    # a signal before "workers ready" must land while the models load: make that slow; after
    # it, a slow load only holds the test up
    load_s = "30" if STACK_UP_PHASES.index(after) < STACK_UP_PHASES.index("workers ready") else "1"
    proc = subprocess.Popen(
        [*argv, "--gpu-load-s", load_s, "--state-root", str(state_root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ignore_sigint if inherit_ignored else None,
    )
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if after in line:
                break
        _, err, took_s = signal_and_wait(proc, sig, 30)
    finally:
        stop_gracefully(proc)
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert "removing what was started" in err
    assert took_s < 15, f"{sig.name} after {after!r} took {took_s:.1f} s to honour"
    for folder in state_root.iterdir():
        assert leftovers(folder.name).empty, leftovers(folder.name).summary()


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "after"), interrupt_cases(STACK_UP_PHASES))
def test_interrupted_stack_up_leaves_nothing(
    tmp_path: Path, sig: signal.Signals, after: str, busy_cores: None
) -> None:
    """At each step of `stack up`, with every core busy: exit 130 within seconds, nothing
    left (a namespace created a moment before the signal used to leak)."""
    for attempt in range(repeat_count()):
        _interrupt_stack_up(tmp_path / f"attempt-{attempt}", sig, after)


@pytest.mark.slow
def test_sigint_is_honoured_when_inherited_as_ignored(tmp_path: Path) -> None:
    """A background job of a non-interactive shell starts with SIGINT ignored; Ctrl-C (or
    kill -INT from a CI runner) must still stop `stack up` and undo it."""
    _interrupt_stack_up(tmp_path, signal.SIGINT, "token table seeded", inherit_ignored=True)
