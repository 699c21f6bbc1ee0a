"""How much CPU this machine had to spare over a span: what a run's figures were measured on.

    start = CpuSample.now()
    ...                                  # the load runs
    cpu = MachineCpu.since(start)
    cpu.idle_cores, cpu.steal_cores      # cores' worth, averaged over the span

On one machine the load, the embedded stack and the faults share the cores, so a run whose
machine had almost nothing idle measured CPU starvation as much as the service: its report
says so. Steal is the time a hypervisor gave this VM's cores to another (a shared CI runner's
neighbours): CPU the run asked for and did not get, which no process here accounts for.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import psutil

__all__ = ["SHORT_OF_CPU_IDLE_CORES", "CpuSample", "MachineCpu"]

SHORT_OF_CPU_IDLE_CORES = 0.1
"""Below this many cores idle on average, a run's report notes that the machine was short of
CPU (a calibrated 2-core run keeps 0.3-0.8 idle: llmchaos.targets.embedded.calibration)."""


@dataclass(frozen=True)
class CpuSample:
    """The machine's cumulative CPU times at one instant."""

    at_s: float
    """time.monotonic() when taken."""
    idle_s: float
    steal_s: float

    @classmethod
    def now(cls) -> CpuSample:
        times = psutil.cpu_times()
        return cls(time.monotonic(), times.idle, getattr(times, "steal", 0.0))


@dataclass(frozen=True)
class MachineCpu:
    """The machine's spare CPU over a span, in cores' worth (idle seconds per second)."""

    cores: int
    """Cores this process may run on."""
    span_s: float
    idle_cores: float
    steal_cores: float

    @classmethod
    def since(cls, start: CpuSample) -> MachineCpu:
        end = CpuSample.now()
        span_s = max(end.at_s - start.at_s, 1e-6)
        return cls(
            cores=len(os.sched_getaffinity(0)),
            span_s=round(span_s, 1),
            idle_cores=round((end.idle_s - start.idle_s) / span_s, 2),
            steal_cores=round((end.steal_s - start.steal_s) / span_s, 2),
        )

    @property
    def short_of_cpu(self) -> bool:
        return self.idle_cores < SHORT_OF_CPU_IDLE_CORES

    def describe(self) -> str:
        """ "0.32 of 2 cores idle, 0.01 stolen by the hypervisor, over 48 s" """
        return (
            f"{self.idle_cores:.2f} of {self.cores} cores idle, {self.steal_cores:.2f} stolen "
            f"by the hypervisor, over {self.span_s:.0f} s"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
