"""Starting a stack's process when a signal comes at that moment; a serving process's own heap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import sigterm_during_popen
from llmchaos.processes import Owner
from llmchaos.stack.procs import find_stack_processes, spawn

STACK_ID = "20261204-000000-5a5a"


def test_a_signal_held_while_a_stack_process_starts_stops_that_process(
    tmp_path: Path,
) -> None:
    """SIGTERM during Popen is held (signals.deferred) and raised as the start ends: the
    caller never gets the process, so spawn must stop it. Seen: a chaos run interrupted in
    starting-target left its redis-server, which had already overwritten its environment
    (marks included) and not yet moved into its folder, where the teardown's sweep looks."""
    with sigterm_during_popen("llmchaos.stack.procs.subprocess.Popen"):
        spawn(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            stack_id=STACK_ID,
            owner=Owner.this_process("user"),
            log_path=tmp_path / "logs" / "sleeper.log",
        )
    left = find_stack_processes(STACK_ID)
    for pid in left:  # a failing test does not leave it either
        os.kill(pid, signal.SIGKILL)
    assert not left


def test_settle_heap_freezes_the_heap_and_collects_the_young_generation_less_often() -> None:
    # in a process of its own: the collector's settings are the whole process's
    code = (
        "import gc; from llmchaos.stack.procs import settle_heap; "
        "before = gc.get_threshold()[0]; settle_heap(); "
        "print(before, gc.get_threshold()[0], gc.get_freeze_count() > 1000)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.split() == ["700", "10000", "True"]
