"""Node faults of the Kubernetes target: cordon, uncordon (the undo) and drain with real
evictions (a PodDisruptionBudget's 429 kept and reported)."""

from __future__ import annotations

from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from llmchaos.errors import InvalidInput, StackError
from llmchaos.targets.kubernetes.cluster import Cluster, http_status, node_of

__all__ = ["NodeFaults"]


class NodeFaults(Cluster):
    """Cordon, uncordon and drain the stack's nodes."""

    def cordon_node(self, node: str) -> dict[str, Any]:
        """Mark a node of the stack unschedulable; returns {"node", "was_unschedulable"}.

        When it was cordoned already, undoing with uncordon_node would uncordon what someone
        else cordoned: callers should record an undo only when was_unschedulable is False.
        """
        known = self.info().nodes
        if node not in known:
            raise InvalidInput(
                f"node: {node!r} runs no pod of namespace {self.namespace}; nodes: "
                f"{', '.join(known) or 'none'}"
            )
        current = self._call(
            "read",
            f"node {node}",
            self._core.read_node,
            node,
            missing=f"node: no node named {node!r}",
        )
        was = bool(current.spec.unschedulable) if current.spec else False
        if self.settings.dry_run:
            return self._plan("cordon_node", node=node, was_unschedulable=was)
        self._set_unschedulable(node, True)
        return {"node": node, "was_unschedulable": was}

    def uncordon_node(self, node: str) -> None:
        """Make a node schedulable again. Idempotent; a node that is gone is nothing to undo."""
        if self.settings.dry_run:
            self._plan("uncordon_node", node=node)
            return
        self._set_unschedulable(node, False, missing_ok=True)

    def _set_unschedulable(self, node: str, value: bool, missing_ok: bool = False) -> None:
        self._call(
            "cordon" if value else "uncordon",
            f"node {node} (patch spec.unschedulable={str(value).lower()})",
            self._core.patch_node,
            node,
            {"spec": {"unschedulable": value or None}},
            _content_type="application/merge-patch+json",
            missing=None if missing_ok else f"node: no node named {node!r}",
            missing_ok=missing_ok,
        )

    def drain_node(self, node: str) -> dict[str, Any]:
        """Cordon `node`, then evict the namespace's pods on it (other namespaces' pods stay:
        the allowlist applies). Undo with uncordon_node.

        Returns {"node", "was_unschedulable", "evicted", "deleted", "blocked", "notes"}. An
        eviction answered 404 (no Eviction API, e.g. an emulator) falls back to deleting the
        pod, which ignores PodDisruptionBudgets, and says so in notes; 429 (a PDB forbids it)
        leaves the pod in place and lists it under blocked.
        """
        cordon = self.cordon_node(node)
        pods = [p.metadata.name for p in self._list_pods() if node_of(p) == node]
        if self.settings.dry_run:
            plan = self._plan("drain_node", node=node, evict=pods)
            return {**plan, "was_unschedulable": cordon["was_unschedulable"]}
        result: dict[str, Any] = {
            "node": node,
            "was_unschedulable": cordon["was_unschedulable"],
            "evicted": [],
            "deleted": [],
            "blocked": [],
            "notes": [],
        }
        for pod in pods:
            eviction = {
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": pod, "namespace": self.namespace},
            }
            try:
                self._core.create_namespaced_pod_eviction(
                    pod, self.namespace, eviction, _request_timeout=self.settings.request_timeout_s
                )
                result["evicted"].append(pod)
                continue
            except ApiException as exc:
                status = http_status(exc)
                if status == 429:
                    result["blocked"].append(pod)
                    continue
                if status != 404:
                    raise self._error("evict", self._pod_ref(pod), exc) from None
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise StackError(
                    f"kubernetes: evict {self._pod_ref(pod)} failed: cannot reach the API "
                    f"server at {self._api.configuration.host}: {exc}"
                ) from None
            # 404: no Eviction API here, or the pod is gone; deleting tells which.
            gone = (
                self._call(
                    "delete",
                    self._pod_ref(pod) + " (eviction fallback)",
                    self._core.delete_namespaced_pod,
                    pod,
                    self.namespace,
                    missing_ok=True,
                )
                is None
            )
            if not gone:
                result["deleted"].append(pod)
                result["notes"].append(
                    f"{pod}: eviction answered 404, pod deleted instead "
                    "(PodDisruptionBudgets not consulted)"
                )
        return result
