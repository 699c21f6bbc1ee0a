"""Targets that faults act on and target-side probes read: one `Backend` per kind of target.

    EmbeddedBackend    the reference stack on this machine (processes, netns, Redis, HAProxy)
    KubernetesBackend  a cluster, through the official kubernetes client (kubernetes.py)

The layer below `llmchaos`: backends know the target, not the run (no ledger, no load, no
Chaos Toolkit). Every method that changes the target is undone by another one, named in
`UNDO_OPS`, and is idempotent, so the run's ledger can replay undos after any failure.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from llmchaos.errors import InvalidInput

__all__ = ["Backend", "TargetInfo", "WorkerRef"]


@dataclass(frozen=True)
class WorkerRef:
    """An engine worker as experiments name it."""

    name: str
    mode: str
    """gpu or cpu."""
    node: str


@dataclass(frozen=True)
class TargetInfo:
    """The names an experiment may use against this target."""

    nodes: tuple[str, ...]
    workers: tuple[WorkerRef, ...]
    gateways: tuple[str, ...]
    partitions_supported: bool
    """False when nodes cannot be cut off (embedded stack without network namespaces)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """The embedded stack's names (gpu-0, node-a, primary) for this target's own ones (pod
    and node names), so the catalogue runs unchanged on a cluster."""

    def _real(self, name: str) -> str:
        """A real name stays itself (a cluster node may well be called node-a)."""
        known = {*self.nodes, *(w.name for w in self.workers), *self.gateways}
        return name if name in known else self.aliases.get(name, name)

    def gpu_workers(self, worker: str = "", node: str = "") -> list[str]:
        """GPU workers selected by name ("*" = all) or by node; real names.

        Raises InvalidInput for unknown names or a selection with no GPU worker in it.
        """
        gpus = [w for w in self.workers if w.mode == "gpu"]
        if bool(worker) == bool(node):
            raise InvalidInput(
                "give exactly one of worker (a name, or '*' for all) and node; got "
                f"worker={worker!r}, node={node!r}"
            )
        if worker == "*":
            picked = gpus
        elif worker:
            known = [w.name for w in gpus]
            if self._real(worker) not in known:
                raise InvalidInput(
                    f"worker: unknown GPU worker {worker!r}; GPU workers: {', '.join(known)}"
                )
            picked = [w for w in gpus if w.name == self._real(worker)]
        else:
            real_node = self.node_name(node)
            picked = [w for w in gpus if w.node == real_node]
        if not picked:
            raise InvalidInput(
                f"node {node!r} runs no GPU worker" if node else "the target has no GPU worker"
            )
        return [w.name for w in picked]

    def node_name(self, node: str) -> str:
        """The real name of `node`; raises InvalidInput when it is not a node of the target."""
        real = self._real(node)
        if real not in self.nodes:
            raise InvalidInput(f"node: unknown node {node!r}; nodes: {', '.join(self.nodes)}")
        return real

    def check_node(self, node: str) -> None:
        """Raises InvalidInput when `node` is not a node of the target."""
        self.node_name(node)

    def gateway_names(self, gateway: str) -> list[str]:
        """Gateways selected by role or name: "primary", "all", or a gateway name."""
        if gateway == "all":
            return list(self.gateways)
        if gateway in ("primary", "backup"):
            named = [g for g in self.gateways if g.endswith("-" + gateway)]
            if named:
                return named
        if self._real(gateway) in self.gateways:
            return [self._real(gateway)]
        raise InvalidInput(
            f"gateway: unknown gateway {gateway!r}; expected primary, all or one of "
            f"{', '.join(self.gateways)}"
        )


class Backend(ABC):
    """What a target must offer; see the module docstring."""

    UNDO_OPS: ClassVar[frozenset[str]] = frozenset({"heal_partition", "restore_gateway"})
    """Methods the ledger may call to undo a fault."""

    @abstractmethod
    def info(self) -> TargetInfo:
        """Names of nodes, workers and gateways."""

    @property
    @abstractmethod
    def gateway_url(self) -> str:
        """Base URL the load sends to (OpenAI-compatible)."""

    @property
    @abstractmethod
    def tokens_file(self) -> str | None:
        """Tokens file for the load, None when the target needs no auth."""

    # -- faults --------------------------------------------------------------------------
    @abstractmethod
    def kill_gpu_process(self, worker: str) -> dict[str, Any]:
        """SIGKILL the process holding worker's GPU; returns {"worker", "pid", ...}."""

    @abstractmethod
    def partition_node(self, node: str) -> None:
        """Drop all traffic in and out of `node` (both directions). Idempotent."""

    @abstractmethod
    def heal_partition(self, node: str) -> None:
        """Undo partition_node. Idempotent."""

    @abstractmethod
    def crash_gateway(self, gateway: str) -> dict[str, Any]:
        """Kill gateway `gateway` (by name) at once; returns {"gateway", "pid"}."""

    @abstractmethod
    def restore_gateway(self, gateway: str) -> None:
        """Start `gateway` again if it is not running and wait for it. Idempotent."""

    @abstractmethod
    def expire_token_cache(self, ttl_s: float) -> int:
        """Delete every `token:*` key (ttl_s = 0) or set its TTL to `ttl_s`; returns the
        number of keys touched."""

    # -- target-side readings ------------------------------------------------------------
    @abstractmethod
    def queue_depth(self) -> float:
        """Requests waiting in the engines: sum of vllm:num_requests_waiting."""

    @abstractmethod
    def healthy_workers(self, mode: str = "") -> int:
        """Workers answering ready, of `mode` (gpu, cpu; "" = any)."""

    def undo(self, op: str, args: dict[str, Any]) -> None:
        """Run undo operation `op`; raises InvalidInput for anything not in UNDO_OPS."""
        if op not in self.UNDO_OPS:
            known = ", ".join(sorted(self.UNDO_OPS))
            raise InvalidInput(f"undo: unknown operation {op!r}; expected one of {known}")
        getattr(self, op)(**args)
