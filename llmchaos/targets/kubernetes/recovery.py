"""Recovery facts of the Kubernetes target in Krkn's terms, from real pod lifecycles."""

from __future__ import annotations

import math
from typing import Any

from llmchaos.targets.kubernetes.cluster import Cluster, condition, node_of, pod_ready, ts
from llmchaos.targets.kubernetes.selectors import parse_selector

__all__ = ["Recovery"]


class Recovery(Cluster):
    """How the stack's pods came back after a fault."""

    def pod_recovery_times(self, selector: str, since_ts: float) -> dict[str, list[dict[str, Any]]]:
        """Recovery of pods created at or after `since_ts` (epoch s, e.g. the kill) matching
        `selector`, in Krkn's terms: {"recovered": [...], "unrecovered": [...]}.

        Each entry: pod_name, namespace, node, pod_rescheduling_time (since_ts until
        scheduled: PodScheduled, else creation), pod_readiness_time (scheduled until Ready)
        and total_recovery_time (their sum), in seconds. Unrecovered pods (not Ready yet) have
        the rescheduling time when scheduled, else None. API timestamps have one-second
        resolution and the server's clock: times are clamped at 0.
        """
        parse_selector(selector, "selector")  # InvalidInput before any request
        floor = math.floor(since_ts)  # creationTimestamp is whole seconds
        recovered: list[dict[str, Any]] = []
        unrecovered: list[dict[str, Any]] = []
        for pod in self._list_pods(selector):
            created = ts(pod.metadata.creation_timestamp)
            if created is None or created < floor or pod.metadata.deletion_timestamp:
                continue
            scheduled_condition = condition(pod, "PodScheduled")
            scheduled = (
                ts(scheduled_condition.last_transition_time)
                if scheduled_condition is not None and scheduled_condition.status == "True"
                else None
            )
            if scheduled is None and node_of(pod):
                scheduled = created
            entry: dict[str, Any] = {
                "pod_name": pod.metadata.name,
                "namespace": self.namespace,
                "node": node_of(pod),
                "pod_rescheduling_time": (
                    max(0.0, scheduled - since_ts) if scheduled is not None else None
                ),
            }
            ready_condition = condition(pod, "Ready")
            ready_at = (
                ts(ready_condition.last_transition_time)
                if pod_ready(pod) and ready_condition is not None
                else None
            )
            if ready_at is None or scheduled is None:
                unrecovered.append(entry)
                continue
            entry["pod_readiness_time"] = max(0.0, ready_at - max(scheduled, since_ts))
            entry["total_recovery_time"] = (
                entry["pod_rescheduling_time"] + entry["pod_readiness_time"]
            )
            recovered.append(entry)
        return {"recovered": recovered, "unrecovered": unrecovered}

    def recovery_facts(self, since_ts: float) -> dict[str, Any] | None:
        """pod_recovery_times of the GPU inference and gateway pods, in the Target's terms."""
        facts: dict[str, Any] = {"recovered": [], "unrecovered": []}
        for selector in (self.settings.gpu_selector, self.settings.gateway_selector):
            times = self.pod_recovery_times(selector, since_ts)
            for state in ("recovered", "unrecovered"):
                facts[state] += [
                    {
                        "name": pod["pod_name"],
                        "node": pod["node"],
                        "rescheduling_time_s": pod["pod_rescheduling_time"],
                        "readiness_time_s": pod.get("pod_readiness_time"),
                        "total_recovery_time_s": pod.get("total_recovery_time"),
                    }
                    for pod in times[state]
                ]
        return facts
