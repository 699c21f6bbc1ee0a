"""The Kubernetes target's gray faults and the checks that each fault took effect.

    hang_gpu_process(pod)    exec `nvidia-smi --query-compute-apps=pid`, then `kill -STOP`
                             them; resume_gpu_process sends `kill -CONT` (the pids are kept
                             in memory; a cleanup after the run was killed lists them again)

What the API cannot do, and so the target refuses before a run (TargetInfo.unsupported):
GPU errors while alive (NVIDIA Dynamo injects them with an LD_PRELOAD shim built into the
image), a slow GPU (`nvidia-smi -lgc` needs a privileged container), CPU throttling and OOM
kills (an in-place resize of the pod's limits is a kubelet's job, and no kubelet here would
enforce it), degraded links (tc in the pod's network namespace: Chaos Mesh's daemon does it
on the node).

The checks read the cluster, not the fault's own report: the killed pid no longer listed by
nvidia-smi, or the deleted pod gone (or replaced: another uid); the hung pid in state T in
/proc; the NetworkPolicy present, of the asked direction, selecting labelled pods (whether a
CNI enforces it cannot be seen through the API, and the evidence says so); fewer token keys;
the node unschedulable.
"""

from __future__ import annotations

import logging
from typing import Any

from llmchaos.errors import InvalidInput, StackError
from llmchaos.ledger import Verification
from llmchaos.targets.kubernetes.cluster import Cluster, node_of

__all__ = ["NVIDIA_SMI", "POLICY_TYPES", "UNSUPPORTED", "Checks"]

log = logging.getLogger("llmchaos.targets.kubernetes")

NVIDIA_SMI = ("nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader")
POLICY_TYPES = {"both": ["Ingress", "Egress"], "ingress": ["Ingress"], "egress": ["Egress"]}
"""NetworkPolicy policyTypes for each partition direction (no rules: all of it denied)."""

UNSUPPORTED = {
    "gpu_errors": "the Kubernetes API cannot make a GPU fail while its pod stays Ready (NVIDIA "
    "Dynamo builds an LD_PRELOAD shim into the image for that)",
    "slow_gpu": "the Kubernetes API cannot slow a GPU down (`nvidia-smi -lgc` needs a "
    "privileged container on the node)",
    "throttle_cpu": "CPU limits change through the kubelet (in-place pod resize), which this "
    "target does not drive",
    "oom_kill_worker": "memory limits change through the kubelet (in-place pod resize), which "
    "this target does not drive",
    "degrade_network": "latency, loss and bandwidth need tc in the pod's network namespace "
    "on its node (Chaos Mesh's daemon), not the API",
}


class Checks(Cluster):
    """Hang/resume through exec, and every fault's check (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hung: dict[str, list[int]] = {}
        """Pids hang_gpu_process stopped, by pod: a stopped process may not show in
        nvidia-smi's answer, and resuming must find it."""

    def _gpu_pids(self, worker: str) -> list[int]:
        listed = self._exec(worker, list(NVIDIA_SMI), self.settings.engine_container)
        return [int(line.strip()) for line in listed.splitlines() if line.strip().isdigit()]

    def hang_gpu_process(self, worker: str) -> dict[str, Any]:
        """SIGSTOP the processes nvidia-smi lists in the pod. Raises StackError when exec or
        the kill fails, or nothing is listed (no fallback: deleting the pod is no hang)."""
        gpu_pods = {p.metadata.name for p in self._role_pods("gpu")}
        if worker not in gpu_pods:
            raise InvalidInput(
                f"worker: {worker!r} is not a GPU inference pod; GPU pods: "
                f"{', '.join(sorted(gpu_pods)) or 'none'}"
            )
        pids = self._gpu_pids(worker)
        if not pids:
            raise StackError(f"{self._pod_ref(worker)}: nvidia-smi lists no compute process")
        self._exec(worker, ["kill", "-STOP", *map(str, pids)], self.settings.engine_container)
        self._hung[worker] = pids
        return {"worker": worker, "pod": worker, "pid": pids[0], "pids": pids}

    def resume_gpu_process(self, worker: str) -> None:
        """SIGCONT what hang_gpu_process stopped. Idempotent; a pod that is gone is nothing
        to resume."""
        pids = self._hung.pop(worker, None)
        try:
            pids = pids or self._gpu_pids(worker)
            if pids:
                self._exec(
                    worker, ["kill", "-CONT", *map(str, pids)], self.settings.engine_container
                )
        except (StackError, InvalidInput) as exc:
            if self._pod_or_none(worker) is not None:
                raise
            log.info("resume %s: the pod is gone (%s)", worker, exc)

    def _pod_or_none(self, name: str) -> Any:
        pods = [p for p in self._list_pods() if p.metadata.name == name]
        return pods[0] if pods else None

    def _pod_replaced(self, name: str, uid: str | None) -> str | None:
        """Evidence that pod `name` (of `uid`) was deleted: gone, terminating or another
        uid; None when it is still there as it was."""
        pod = self._pod_or_none(name)
        if pod is None:
            return f"pod {name} gone"
        if pod.metadata.deletion_timestamp is not None:
            return f"pod {name} terminating"
        if uid and pod.metadata.uid != uid:
            return f"pod {name} replaced (uid {uid[:8]} -> {pod.metadata.uid[:8]})"
        return None

    # -- checks --------------------------------------------------------------------------
    def verify_kill_gpu_process(self, details: dict[str, Any]) -> Verification:
        lines, in_effect = [], True
        for item in details.get("killed") or []:
            worker = str(item["worker"])
            if item.get("deleted_pod"):
                seen = self._pod_replaced(worker, item.get("uid"))
                in_effect = in_effect and seen is not None
                lines.append(seen or f"pod {worker} still there, same uid")
                continue
            try:
                listed = self._gpu_pids(worker)
            except StackError as exc:
                listed, note = [], f" (nvidia-smi: {exc})"
            else:
                note = ""
            still = sorted(set(item.get("pids", [])) & set(listed))
            in_effect = in_effect and not still
            lines.append(
                f"{worker}: pids {still} still listed by nvidia-smi"
                if still
                else f"{worker}: pid(s) {item.get('pids')} no longer listed by nvidia-smi "
                f"(now {listed or 'none'}){note}"
            )
        return Verification(in_effect and bool(lines), "; ".join(lines) or "nothing was killed")

    def verify_hang_gpu_process(self, details: dict[str, Any]) -> Verification:
        worker, pid = str(details["worker"]), int(details["pid"])
        try:
            stat = self._exec(worker, ["cat", f"/proc/{pid}/stat"], self.settings.engine_container)
        except StackError as exc:
            return Verification(False, f"{worker}: cannot read /proc/{pid}/stat: {exc}")
        state = stat.rsplit(")", 1)[-1].split()[:1]
        seen = state[0] if state else "?"
        return Verification(seen == "T", f"{worker}: pid {pid} in state {seen} (T: stopped)")

    def verify_crash_gateway(self, details: dict[str, Any]) -> Verification:
        seen = self._pod_replaced(str(details["pod"]), details.get("uid"))
        return Verification(seen is not None, seen or f"pod {details['pod']} still there")

    def verify_drain_node(self, details: dict[str, Any]) -> Verification:
        node = str(details["node"])
        current = self._core.read_node(node, _request_timeout=self.settings.request_timeout_s)
        cordoned = bool(current.spec and current.spec.unschedulable)
        left = [
            p.metadata.name
            for p in self._list_pods()
            if node_of(p) == node and p.metadata.deletion_timestamp is None
        ]
        blocked = set(details.get("blocked") or [])
        stray = sorted(set(left) - blocked)
        return Verification(
            cordoned and not stray,
            f"node {node} {'unschedulable' if cordoned else 'schedulable'}; pods left on it: "
            f"{', '.join(left) or 'none'} ({len(blocked)} kept by a PodDisruptionBudget)",
        )
