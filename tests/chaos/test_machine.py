"""The machine's spare CPU over a span (llmchaos.machine): the arithmetic on known CPU
times, then one real span with a core kept busy."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from llmchaos import machine
from llmchaos.machine import CpuSample, MachineCpu


def test_idle_and_steal_are_seconds_per_second_of_the_span(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    start = CpuSample(at_s=100.0, idle_s=50.0, steal_s=1.0)
    monkeypatch.setattr(machine.time, "monotonic", lambda: 104.0)
    monkeypatch.setattr(machine.psutil, "cpu_times", lambda: SimpleNamespace(idle=53.0, steal=1.2))
    cpu = MachineCpu.since(start)
    assert (cpu.span_s, cpu.idle_cores, cpu.steal_cores) == (4.0, 0.75, 0.05)
    assert cpu.describe() == (
        f"0.75 of {len(os.sched_getaffinity(0))} cores idle, 0.05 stolen by the hypervisor, "
        "over 4 s"
    )
    assert not cpu.short_of_cpu
    assert MachineCpu(2, 4.0, 0.05, 0.0).short_of_cpu


def test_a_core_kept_busy_is_not_counted_idle() -> None:
    start = CpuSample.now()
    until = time.monotonic() + 1.0
    while time.monotonic() < until:
        pass
    cpu = MachineCpu.since(start)
    # this loop held one core the whole span, so at most the others were idle
    assert cpu.idle_cores <= cpu.cores - 0.8, cpu
    assert cpu.span_s >= 1.0
