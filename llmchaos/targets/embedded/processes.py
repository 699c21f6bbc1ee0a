"""Process faults of the embedded stack and their checks: a GPU process killed or hung, a
gateway crashed.

The evidence comes from the kernel, not from the fault's own report: a killed pid is gone
from /proc (and its node agent, the kubelet here, starts a new pid), a hung one is in state
T (stopped by a signal), a crashed gateway's pid is gone.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmchaos.errors import StackError
from llmchaos.ledger import Verification
from llmchaos.processes import pid_alive, process_state, wait_for_state
from llmchaos.stack.topology import read_agent_state

if TYPE_CHECKING:
    from llmchaos.stack.topology import Topology

__all__ = ["ProcessFaults", "pid_gone"]

_GONE_WITHIN_S = 2.0
"""A SIGKILLed process is gone from /proc within this (its parent reaps it at once)."""
_NEW_PID_WITHIN_S = 5.0
"""How long past the agent's restart delay the check waits for the new pid."""
_POLL_S = 0.05


def poll(check: Any, timeout_s: float) -> tuple[Any, float]:
    """(first truthy value of `check()`, seconds it took), or (None, timeout_s)."""
    start = time.monotonic()
    while True:
        value = check()
        if value:
            return value, time.monotonic() - start
        if time.monotonic() - start >= timeout_s:
            return None, timeout_s
        time.sleep(_POLL_S)


def pid_gone(who: str, pid: int) -> Verification:
    """`who`'s process `pid` gone from /proc within a SIGKILLed process's time to go."""
    gone, after_s = poll(lambda: not pid_alive(pid), _GONE_WITHIN_S)
    if gone:
        return Verification(True, f"{who}: pid {pid} gone within {after_s:.2f} s")
    return Verification(
        False, f"{who}: pid {pid} still alive (state {process_state(pid)}) {after_s:g} s later"
    )


class ProcessFaults:
    """Kill, hang and resume GPU processes; check those and gateway crashes."""

    if TYPE_CHECKING:

        @property
        def topology(self) -> Topology: ...

        def _agent_restart_delay_s(self) -> float: ...

    def gpu_process(self, worker: str) -> dict[str, Any]:
        """The process holding worker's GPU, as its /gpu/processes lists it (nvidia-smi's
        view). Raises StackError when the worker does not answer (dead, loading, hung)."""
        url = self.topology.worker(worker).url + "/gpu/processes"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                processes = json.loads(response.read())
        except (OSError, ValueError) as exc:
            raise StackError(f"{worker}: cannot read {url}: {exc}") from None
        if not isinstance(processes, list) or not processes:
            raise StackError(f"{worker}: no process holds its GPU ({url} lists none)")
        return dict(processes[0])

    def _signal(self, worker: str, pid: int, sig: signal.Signals) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            raise StackError(f"{worker}: GPU process {pid} was already gone") from None

    def kill_gpu_process(self, worker: str) -> dict[str, Any]:
        """SIGKILL the pid holding the worker's GPU. Raises StackError when the worker does
        not answer (dead, loading, partitioned)."""
        process = self.gpu_process(worker)
        pid = int(process["pid"])
        killed_at = time.time()
        self._signal(worker, pid, signal.SIGKILL)
        return {
            "worker": worker,
            "pid": pid,
            "process_name": process.get("process_name"),
            "killed_at": killed_at,
        }

    def hang_gpu_process(self, worker: str) -> dict[str, Any]:
        """SIGSTOP the pid holding the worker's GPU: its port still accepts connections (the
        kernel completes the handshakes), nothing answers."""
        process = self.gpu_process(worker)
        pid = int(process["pid"])
        self._signal(worker, pid, signal.SIGSTOP)
        return {"worker": worker, "pid": pid}

    def resume_gpu_process(self, worker: str) -> None:
        """SIGCONT the worker's process (the agent's view: the pid it runs now). Idempotent."""
        pid = self._agent_pid(worker)
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGCONT)

    def _agent_pid(self, worker: str) -> int | None:
        """The pid the worker's node agent runs it as now (None before the agent wrote it)."""
        node = self.topology.node(self.topology.worker(worker).node)
        state = read_agent_state(Path(node.agent_state_path))
        entry = state.workers.get(worker) if state else None
        return entry.pid if entry else None

    def _restarted(self, worker: str, old_pid: int, since: float = 0.0) -> tuple[bool, str]:
        """Whether the node agent (the kubelet here) started a new pid for `worker` after
        `since` (epoch s), and the evidence. A worker still running as a pid started
        before `since` was never hit: the signal went to another process."""
        node = self.topology.node(self.topology.worker(worker).node)

        def restarted() -> int | None:
            state = read_agent_state(Path(node.agent_state_path))
            entry = state.workers.get(worker) if state else None
            if entry is None or entry.pid == old_pid or entry.started_at < since:
                return None
            return entry.pid

        new, after_s = poll(restarted, self._agent_restart_delay_s() + _NEW_PID_WITHIN_S)
        if new:
            return True, f"new pid {new} {after_s:.1f} s later"
        now = self._agent_pid(worker)
        if now is not None and now != old_pid and pid_alive(now):
            return False, f"but {worker} still runs as pid {now}, started before: never hit"
        return False, f"no new pid within {after_s:.1f} s"

    # -- checks --------------------------------------------------------------------------
    def verify_kill_gpu_process(self, details: dict[str, Any]) -> Verification:
        """Each killed pid gone from /proc, then a new pid its node agent started after the
        kill."""
        killed = details.get("killed") or []
        if not killed:
            return Verification(False, "no process was killed")
        lines, in_effect = [], True
        for item in killed:
            worker, pid = str(item["worker"]), int(item["pid"])
            gone = pid_gone(worker, pid)
            if not gone.in_effect:
                in_effect = False
                lines.append(gone.evidence)
                continue
            # a pid that exited before the kill is gone too: the restart tells the two apart
            restarted, how = self._restarted(worker, pid, float(item.get("killed_at", 0.0)))
            in_effect = in_effect and restarted
            lines.append(f"{gone.evidence}; {how}")
        return Verification(in_effect, "; ".join(lines))

    def verify_hang_gpu_process(self, details: dict[str, Any]) -> Verification:
        """The pid in state T (stopped by a signal)."""
        pid = int(details["pid"])
        seen = wait_for_state(pid, "T") or "gone"
        return Verification(
            seen == "T", f"{details['worker']}: pid {pid} in state {seen} (T: stopped)"
        )

    def verify_crash_gateway(self, details: dict[str, Any]) -> Verification:
        """The gateway's pid gone from /proc."""
        return pid_gone(str(details["gateway"]), int(details["pid"]))
