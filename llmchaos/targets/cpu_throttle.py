"""CPU throttling of processes on this machine, for every target whose processes run here
(the embedded stack, the hosts target): the kernel's CFS bandwidth control through a cgroup
of llmchaos's own (llmchaos.stack.cgroups), checked by the kernel's throttling counters.

    details = throttle("llmc-1a2b-gpu-0", "gpu-0", [pid], cpu_percent=5)
    verify_throttle("llmc-1a2b-gpu-0", details)   # nr_throttled and throttled_usec rising
    unthrottle("llmc-1a2b-gpu-0")                 # the pids back where they were
"""

from __future__ import annotations

import time
from typing import Any

from llmchaos.errors import InvalidInput
from llmchaos.ledger import Verification
from llmchaos.stack import cgroups

__all__ = [
    "CPU_PERIOD_US",
    "MIN_CPU_PERCENT",
    "cpu_max",
    "throttle",
    "unthrottle",
    "verify_throttle",
]

CPU_PERIOD_US = 100_000
"""CFS enforcement period (the kernel's default, 100 ms): the quota is a share of it."""
MIN_QUOTA_US = 1000
"""The kernel's floor for a quota (1 ms): below 1% the period grows instead."""
MAX_PERIOD_US = 1_000_000
"""The kernel's ceiling for a period (1 s)."""
MIN_CPU_PERCENT = 100 * MIN_QUOTA_US / MAX_PERIOD_US
"""The least share of a CPU a cap can give: 1 ms per 1 s, 0.1%."""
_THROTTLE_CHECK_S = 5.0
"""How long the check waits for the throttling counters to rise (they need the process to
want more CPU than its quota: under the run's load that takes a period or two)."""


def throttle(cgroup_name: str, part: str, pids: list[int], cpu_percent: float) -> dict[str, Any]:
    """Move `pids` (a process and its children: a server whose engine runs in a child is
    throttled whole) into cgroup `cgroup_name` capped at `cpu_percent` of one CPU; returns
    the ledger's details. Raises StackError when the kernel refuses."""
    quota_us, period_us = cpu_max(cpu_percent)
    group = cgroups.create("cpu", cgroup_name, pids[0])
    for pid in pids[1:]:
        group.add(pid)
    group.set_cpu_max(quota_us, period_us)
    return {
        "part": part,
        "pid": pids[0],
        "pids": pids,
        "cgroup": str(group.path),
        "cgroup_version": group.version,
        "quota_us": quota_us,
        "period_us": period_us,
        "cpu_stat_before": group.cpu_stat(),
    }


def cpu_max(cpu_percent: float) -> tuple[int, int]:
    """(quota_us, period_us) for `cpu_percent` of one CPU: the default 100 ms period, or a
    longer one where the quota would fall under the kernel's 1 ms floor (0.5%: 1 ms per
    200 ms), so a cap under 1% is what was asked and not silently 1%. Raises InvalidInput
    under MIN_CPU_PERCENT."""
    if cpu_percent < MIN_CPU_PERCENT:
        raise InvalidInput(
            f"cpu_percent: expected at least {MIN_CPU_PERCENT:g} (1 ms per 1 s, the kernel's "
            f"least quota per its longest period), got {cpu_percent:g}"
        )
    quota_us = round(CPU_PERIOD_US * cpu_percent / 100)
    if quota_us >= MIN_QUOTA_US:
        return quota_us, CPU_PERIOD_US
    return MIN_QUOTA_US, round(MIN_QUOTA_US * 100 / cpu_percent)


def unthrottle(cgroup_name: str) -> None:
    """Lift `throttle` (idempotent)."""
    group = cgroups.find("cpu", cgroup_name)
    if group is not None:
        cgroups.remove(group)


def verify_throttle(cgroup_name: str, details: dict[str, Any]) -> Verification:
    """The process in the cgroup, the quota set, and the kernel throttling it: nr_throttled
    and throttled_usec rising."""
    group = cgroups.find("cpu", cgroup_name)
    pid = int(details["pid"])
    if group is None or pid not in group.pids():
        where = "no such cgroup" if group is None else f"pids {group.pids()}"
        return Verification(False, f"pid {pid} is not in {details['cgroup']} ({where})")
    before = group.cpu_stat()
    deadline = time.monotonic() + _THROTTLE_CHECK_S
    while True:
        time.sleep(0.5)
        now = group.cpu_stat()
        throttled = now["nr_throttled"] - before["nr_throttled"]
        waited_us = now["throttled_usec"] - before["throttled_usec"]
        evidence = (
            f"{group.describe()}: quota {details['quota_us']}/{details['period_us']} us; "
            f"nr_throttled +{throttled}, throttled_usec +{waited_us} over "
            f"{now['nr_periods'] - before['nr_periods']} periods"
        )
        if throttled > 0 or time.monotonic() >= deadline:
            return Verification(throttled > 0, evidence)
