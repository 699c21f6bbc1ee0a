"""Resource faults of the embedded stack: CPU throttling and OOM kills through cgroups.

    throttle_cpu("gateway-primary", 5)   # cgroup llmc-<id>-gateway-primary, 5% of one CPU
    oom_kill_worker("gpu-0", 64, 64)     # cgroup llmc-<id>-gpu-0 with a 64 MiB limit; the
                                         #  worker grows 64 MiB/s until the OOM killer acts

The processes are moved into cgroups of their own (llmchaos.stack.cgroups), named after the
stack and the part, which the stack's teardown and `llmchaos cleanup` remove. The checks read
the kernel's counters of those cgroups: nr_throttled and throttled_usec rising, oom_kill.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from llmchaos.errors import StackError
from llmchaos.ledger import Verification
from llmchaos.processes import pid_alive
from llmchaos.stack import cgroups
from llmchaos.targets import cpu_throttle

if TYPE_CHECKING:
    from llmchaos.stack.topology import Topology

__all__ = ["ResourceFaults"]

_OOM_MARGIN_S = 10.0
"""Past the time the growth needs to reach the limit, how long the check waits for the OOM
killer."""


class ResourceFaults:
    """cgroup faults (see the module docstring)."""

    if TYPE_CHECKING:

        @property
        def topology(self) -> Topology: ...

        def _agent_pid(self, worker: str) -> int | None: ...

        def _restarted(self, worker: str, old_pid: int, since: float = 0.0) -> tuple[bool, str]: ...

        def _worker_control(
            self, worker: str, path: str, body: dict[str, Any]
        ) -> dict[str, Any]: ...

    def _cgroup_name(self, part: str) -> str:
        return f"{cgroups.CGROUP_PREFIX}{self.topology.stack_id[-4:]}-{part}"

    def _part_pid(self, part: str) -> int:
        """The pid of a worker (its agent's view) or of a gateway, alive."""
        for gateway in self.topology.gateways:
            if gateway.name == part:
                pid: int | None = gateway.pid
                break
        else:
            pid = self._agent_pid(part)
        if pid is None or not pid_alive(pid):
            raise StackError(f"{part}: not running (pid {pid})")
        return pid

    def throttle_cpu(self, part: str, cpu_percent: float) -> dict[str, Any]:
        return cpu_throttle.throttle(
            self._cgroup_name(part), part, [self._part_pid(part)], cpu_percent
        )

    def unthrottle_cpu(self, part: str) -> None:
        cpu_throttle.unthrottle(self._cgroup_name(part))

    def oom_kill_worker(self, worker: str, limit_mib: float, grow_mib_s: float) -> dict[str, Any]:
        pid = self._part_pid(worker)
        group = cgroups.create("memory", self._cgroup_name(worker), pid)
        group.set_memory_max(int(limit_mib * (1 << 20)))
        self._worker_control(worker, "/fault/memory", {"grow_mib_s": grow_mib_s})
        return {
            "worker": worker,
            "pid": pid,
            "cgroup": str(group.path),
            "cgroup_version": group.version,
            "limit_mib": limit_mib,
            "grow_mib_s": grow_mib_s,
        }

    def unlimit_memory(self, worker: str) -> None:
        group = cgroups.find("memory", self._cgroup_name(worker))
        if group is None:
            return
        if group.pids():  # still alive: stop its growth first, then lift the limit
            # being killed or restarted meanwhile: removing the cgroup is enough
            with contextlib.suppress(StackError):
                self._worker_control(worker, "/fault/memory", {"grow_mib_s": 0})
        cgroups.remove(group)

    # -- checks --------------------------------------------------------------------------
    def verify_throttle_cpu(self, details: dict[str, Any]) -> Verification:
        return cpu_throttle.verify_throttle(self._cgroup_name(str(details["part"])), details)

    def verify_oom_kill_worker(self, details: dict[str, Any]) -> Verification:
        """The cgroup's oom_kill counter (the kernel's OOM killer acted in it), the pid gone,
        and a new pid from the node agent."""
        worker, pid = str(details["worker"]), int(details["pid"])
        group = cgroups.find("memory", self._cgroup_name(worker))
        if group is None:
            return Verification(False, f"{worker}: its memory cgroup {details['cgroup']} is gone")
        wait_s = float(details["limit_mib"]) / float(details["grow_mib_s"]) + _OOM_MARGIN_S
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            events = group.memory_events()
            if events["oom_kill"] > 0 and not pid_alive(pid):
                break
            time.sleep(0.1)
        events = group.memory_events()
        killed_by_oom = events["oom_kill"] > 0 and not pid_alive(pid)
        evidence = (
            f"{group.describe()}: limit {details['limit_mib']:g} MiB, oom_kill "
            f"{events['oom_kill']}, limit hit {events['max']} times; pid {pid} "
            f"{'gone' if not pid_alive(pid) else 'alive'}"
        )
        if killed_by_oom:
            evidence += f"; {self._restarted(worker, pid)[1]}"
        else:
            evidence += f" after {wait_s:.0f} s"
        return Verification(killed_by_oom, evidence)
