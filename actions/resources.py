"""Resource faults: CPU throttling and OOM kills through the kernel's cgroups."""

from __future__ import annotations

from typing import Any

from llmchaos import faults
from llmchaos.run import current_run

__all__ = ["oom_kill_worker", "throttle_cpu", "unthrottle_cpu"]


def throttle_cpu(part: str, cpu_percent: float = 5.0, hold_s: float = 0.0) -> dict[str, Any]:
    """Cap `part` (a worker, or a gateway: primary, backup or a name) at `cpu_percent` of one
    CPU with the kernel's CFS bandwidth control (cgroup v2 cpu.max, v1 cpu.cfs_quota_us): a
    quota per 100 ms period; under 1%, 1 ms per a longer period (0.5%: per 200 ms); at least
    0.1. Until unthrottle_cpu or the run's end; a recovery counts only once it outlasts
    `hold_s` of the throttle. Returns the cgroup, its quota and period and its throttling
    counters (nr_throttled, throttled_usec) before."""
    return faults.throttle_cpu(current_run(), part, cpu_percent, hold_s)


def unthrottle_cpu(part: str) -> str:
    """Lift throttle_cpu (idempotent)."""
    return faults.unthrottle_cpu(current_run(), part)


def oom_kill_worker(
    worker: str, limit_mib: float = 64.0, grow_mib_s: float = 64.0
) -> dict[str, Any]:
    """A memory limit of `limit_mib` on `worker`'s process (cgroup v2 memory.max, v1
    memory.limit_in_bytes) while it grows by `grow_mib_s` a second, until the kernel's OOM
    killer kills it; its node agent (kubelet) restarts it. The limit goes at the run's end."""
    return faults.oom_kill_worker(current_run(), worker, limit_mib, grow_mib_s)
