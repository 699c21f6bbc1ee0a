"""Targets: what a chaos run breaks and reads, each reached through this one door.

    kind = target_kind("embedded")                 # or "k8s", "hosts" (registry below)
    settings = kind.settings(configuration, environ)
    info = kind.plan(settings)                     # names, checked before anything changes
    target = kind.open(settings, owner)            # start it (embedded) or connect to it
    details = target.kill_gpu_process("gpu-0")     # faults; each undone by an op in UNDO_OPS
    target.verify("kill_gpu_process", details)     # did it take effect? (Verification)
    target.undo("heal_partition", {"node": "node-a"})
    target.close()                                 # stop what open() started
    kind.finish_dead_run(record, ledger)           # a killed run's open faults
    kind.cleanup(request)                          # what dead owners left on this machine

    Target          a live target: faults with their undo, readings, lifecycle
    TargetKind      one kind of target: its settings, planning, opening, cleanup
    TargetSettings  base of each kind's settings dataclass (its own configuration keys)
    TargetInfo      the names an experiment may use (workers, nodes, gateways)

The run layer (llmchaos.run, control, settings, validation, ...) imports this module only,
never a kind's package; the kinds are found by name in `KINDS` and imported when first used
(the Kubernetes client alone takes a third of a second to import). The layer below: a target
knows nothing of the run (no ledger writes, no load, no Chaos Toolkit).
"""

from __future__ import annotations

import contextlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from llmchaos.configuration import build_settings, settings_from_record, settings_keys
from llmchaos.errors import InvalidInput
from llmchaos.ledger import FaultLedger, Undo, Verification
from llmchaos.load.traffic import TrafficSpec
from llmchaos.processes import Owner

__all__ = [
    "DEFAULT_VARIANT",
    "KINDS",
    "CleanupRequest",
    "LoadWorkersPlan",
    "Replicas",
    "Target",
    "TargetInfo",
    "TargetKind",
    "TargetSettings",
    "Verification",
    "WorkerRef",
    "register_kind",
    "target_kind",
]


@dataclass(frozen=True)
class LoadWorkersPlan:
    """Load workers a target runs itself (a cluster's Locust worker Deployment), known
    before they start: what the run's Locust master must expect and where they dial it."""

    name: str
    undo: Undo
    """Removes them (the ledger's entry comes first)."""
    replicas: int
    """Workers the master waits for (LoadConfig.remote_workers)."""
    master_address: str
    """HOST:PORT the workers dial; the master listens on every address at that port."""
    join_timeout_s: float
    """How long the master waits for them before time zero (pods scheduled, images pulled)."""


DEFAULT_VARIANT = "hardened"
"""The target as it should be; every other variant is a known-bad one."""

KINDS: dict[str, str] = {
    "embedded": "llmchaos.targets.embedded:KIND",
    "k8s": "llmchaos.targets.kubernetes:KIND",
    "hosts": "llmchaos.targets.hosts:KIND",
}
"""Target name -> "module:attribute" of its TargetKind."""

_loaded: dict[str, TargetKind] = {}


def target_kind(name: str) -> TargetKind:
    """The kind of target called `name`; raises InvalidInput listing the known ones."""
    if name not in _loaded:
        where = KINDS.get(name)
        if where is None:
            raise InvalidInput(f"target: expected one of {', '.join(KINDS)}, got {name!r}")
        module, _, attribute = where.partition(":")
        _loaded[name] = getattr(importlib.import_module(module), attribute)
    return _loaded[name]


def register_kind(name: str, kind: TargetKind) -> None:
    """Make `kind` a target called `name` (tests: a fake target behind the same door)."""
    KINDS[name] = f"{type(kind).__module__}:<registered>"
    _loaded[name] = kind


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
    partitions_need: str = "root"
    """What partitions would need where they are not supported, for the message that says so."""
    drains_supported: bool = False
    """True when nodes can be drained (cordoned, their pods evicted): a cluster."""
    registry_members: tuple[str, ...] = ()
    """Members of the service registry the gateways find their workers in (embedded stack
    with discovery etcd); () when there is none to break."""
    aliases: dict[str, str] = field(default_factory=dict)
    """The embedded stack's names (gpu-0, node-a, primary) for this target's own ones (pod
    and node names), so the catalogue runs unchanged on a cluster."""
    unsupported: dict[str, str] = field(default_factory=dict)
    """Faults this target cannot inject here, each with the reason (the cluster API has no
    way to make a GPU throw Xid errors; this kernel has no netem): validation refuses an
    experiment that uses one before anything starts. `<fault>:<argument>` refuses only that
    argument above 0 (`degrade_network:rate_kbit`)."""

    def refused_argument(self, fault: str, numbers: Mapping[str, float]) -> str | None:
        """Why this target cannot do `fault` with these arguments (the first above 0 that it
        refuses, named), None when it can."""
        for name, value in numbers.items():
            reason = self.unsupported.get(f"{fault}:{name}")
            if value and reason:
                return f"{name}: {reason}"
        return None

    def _real(self, name: str) -> str:
        """A real name stays itself (a cluster node may well be called node-a)."""
        known = {*self.nodes, *(w.name for w in self.workers), *self.gateways}
        return name if name in known else self.aliases.get(name, name)

    @property
    def gpu_count(self) -> int:
        """GPU workers the target has (dead or loading ones included)."""
        return sum(1 for worker in self.workers if worker.mode == "gpu")

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

    def registry_member_names(self, member: str) -> list[str]:
        """Registry members selected by name or "all" ("leader" is resolved by the target
        when the fault acts). Raises InvalidInput for an unknown name or no registry."""
        if not self.registry_members:
            raise InvalidInput(
                "member: the target has no service registry to break (embedded stack: set "
                "discovery: etcd)"
            )
        if member == "all":
            return list(self.registry_members)
        if member not in self.registry_members:
            raise InvalidInput(
                f"member: unknown registry member {member!r}; expected leader, all or one of "
                f"{', '.join(self.registry_members)}"
            )
        return [member]

    def check_node(self, node: str) -> None:
        """Raises InvalidInput when `node` is not a node of the target."""
        self.node_name(node)

    def part_name(self, part: str) -> str:
        """The real name of a worker or a gateway (primary, backup or a name); raises
        InvalidInput listing both."""
        workers = [w.name for w in self.workers]
        if self._real(part) in workers:
            return self._real(part)
        if part != "all":
            with contextlib.suppress(InvalidInput):
                return self.gateway_names(part)[0]
        raise InvalidInput(
            f"part: expected a worker ({', '.join(workers)}) or a gateway (primary, backup, "
            f"{', '.join(self.gateways)}), got {part!r}"
        )

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


@dataclass(frozen=True)
class Replicas:
    """The GPU pool's size as its autoscaler sees it: what it asks and what serves."""

    desired: int
    """The replica count asked for (the HPA's decision: the Deployment's spec.replicas, the
    embedded stack's replicas file)."""
    ready: int
    """Replicas ready to serve."""
    min_replicas: int | None = None
    max_replicas: int | None = None
    autoscaled: bool = False
    """An autoscaler acts on the pool (False: nothing would change the count)."""
    detail: str = ""
    """What the autoscaler last said, when the target can tell (HPA conditions, ...)."""


@dataclass(frozen=True)
class TargetSettings:
    """Base of every kind's settings dataclass: each field has a default and a docstring."""

    variant: str = DEFAULT_VARIANT
    """Which variant of the target: the default, or a known-bad one that removes exactly one
    protection (the negative controls). Each kind says which it has."""

    def to_record(self) -> dict[str, Any]:
        """JSON data for run.json (secrets are masked by whoever writes it)."""
        return asdict(self)


@dataclass(frozen=True)
class _Variant:
    variant: str = DEFAULT_VARIANT


class Target(ABC):
    """A live target: what faults act on and target-side probes read.

    Every method that changes the target is undone by one named in `UNDO_OPS` and is
    idempotent, so the run's ledger can replay undos after any failure.
    """

    UNDO_OPS: ClassVar[frozenset[str]] = frozenset(
        {
            "heal_partition",
            "restore_gateway",
            "restart_registry_member",
            "heal_registry_member",
            "resume_gpu_process",
            "clear_gpu_fault",
            "unthrottle_cpu",
            "unlimit_memory",
            "restore_network",
        }
    )
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

    def record(self) -> dict[str, Any]:
        """What run.json keeps to find this target again (a killed run's cleanup)."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """The run is over: stop what opening it started (the embedded stack), or just let
        go of it (a cluster). Safe to call twice."""

    # -- faults --------------------------------------------------------------------------
    @abstractmethod
    def kill_gpu_process(self, worker: str) -> dict[str, Any]:
        """SIGKILL the process holding worker's GPU; returns {"worker", "pid", ...}."""

    @abstractmethod
    def partition_node(self, node: str, direction: str = "both") -> None:
        """Drop traffic of `node`: "both" ways, only "ingress" (into it) or only "egress" (out
        of it: a partial, one-way partition). Idempotent."""

    @abstractmethod
    def heal_partition(self, node: str) -> None:
        """Undo partition_node, whatever its direction. Idempotent."""

    @abstractmethod
    def crash_gateway(self, gateway: str) -> dict[str, Any]:
        """Kill gateway `gateway` (by name) at once; returns {"gateway", "pid"}."""

    @abstractmethod
    def restore_gateway(self, gateway: str) -> None:
        """Start `gateway` again if it is not running and wait for it. Idempotent."""

    def drain_node(self, node: str) -> dict[str, Any]:
        """Cordon `node` and evict the stack's pods from it (undo: `uncordon_node`); returns
        what was done, with "was_unschedulable" when it was cordoned before. InvalidInput on
        targets without nodes to drain (TargetInfo.drains_supported)."""
        raise InvalidInput(f"drain_node: {type(self).__name__} has no nodes to drain")

    def registry_leader(self) -> str:
        """The registry member that leads now. InvalidInput on targets without a registry."""
        raise InvalidInput(f"{type(self).__name__}: no service registry")

    def kill_registry_member(self, member: str) -> dict[str, Any]:
        """SIGKILL registry member `member` (undo: `restart_registry_member`)."""
        raise InvalidInput(f"{type(self).__name__}: no service registry")

    def restart_registry_member(self, member: str) -> None:
        """Start a killed registry member again from its data. Idempotent."""
        raise InvalidInput(f"{type(self).__name__}: no service registry")

    def wait_registry_ready(self, timeout_s: float = 30.0) -> None:
        """Until every registry member serves (a quorum and a leader). Raises
        ComponentNotReady past `timeout_s`."""
        raise InvalidInput(f"{type(self).__name__}: no service registry")

    def partition_registry_member(self, member: str) -> None:
        """Drop every packet in and out of registry member `member` (undo:
        `heal_registry_member`). Idempotent."""
        raise InvalidInput(f"{type(self).__name__}: no service registry")

    def heal_registry_member(self, member: str) -> None:
        """Undo partition_registry_member. Idempotent."""
        raise InvalidInput(f"{type(self).__name__}: no service registry")

    @abstractmethod
    def expire_token_cache(self, ttl_s: float) -> int:
        """Delete every cached token (ttl_s = 0) or set its TTL to `ttl_s`; returns the
        number of keys touched."""

    # Gray failures and resource faults: each raises InvalidInput on targets that cannot
    # inject it (TargetInfo.unsupported says why, before the run); their undos do nothing
    # there (nothing was done).
    def hang_gpu_process(self, worker: str) -> dict[str, Any]:
        """SIGSTOP the process holding worker's GPU (a hung GPU: the process is there, its
        port accepts connections, nothing answers); undo: resume_gpu_process."""
        raise self._unsupported("hang_gpu_process")

    def resume_gpu_process(self, worker: str) -> None:
        """SIGCONT what hang_gpu_process stopped. Idempotent."""
        return  # where the fault cannot be injected there is nothing to undo

    def gpu_errors(self, worker: str, xid: int) -> dict[str, Any]:
        """Make worker's GPU fail inference while its health checks still pass (as after an
        Xid error): plain requests get 500, streams break after their first token; undo:
        clear_gpu_fault."""
        raise self._unsupported("gpu_errors")

    def slow_gpu(self, worker: str, factor: float) -> dict[str, Any]:
        """Make every engine step of worker `factor` times slower, without errors (a GPU
        throttling its clocks); undo: clear_gpu_fault."""
        raise self._unsupported("slow_gpu")

    def clear_gpu_fault(self, worker: str) -> None:
        """Undo gpu_errors and slow_gpu. Idempotent."""
        return  # where the fault cannot be injected there is nothing to undo

    def throttle_cpu(self, part: str, cpu_percent: float) -> dict[str, Any]:
        """Cap a worker's or gateway's CPU at `cpu_percent` of one CPU with the kernel's CFS
        bandwidth control (cgroup v2 cpu.max, v1 cpu.cfs_quota_us); undo: unthrottle_cpu."""
        raise self._unsupported("throttle_cpu")

    def unthrottle_cpu(self, part: str) -> None:
        """Undo throttle_cpu. Idempotent."""
        return  # where the fault cannot be injected there is nothing to undo

    def oom_kill_worker(self, worker: str, limit_mib: float, grow_mib_s: float) -> dict[str, Any]:
        """Put a memory limit of `limit_mib` on the worker's process (cgroup v2 memory.max, v1
        memory.limit_in_bytes) while it grows by `grow_mib_s` a second, until the kernel's OOM
        killer kills it; undo: unlimit_memory."""
        raise self._unsupported("oom_kill_worker")

    def unlimit_memory(self, worker: str) -> None:
        """Undo oom_kill_worker (remove the limit; a process still growing stops).
        Idempotent."""
        return  # where the fault cannot be injected there is nothing to undo

    def degrade_network(
        self,
        node: str,
        delay_ms: float,
        jitter_ms: float,
        loss_percent: float,
        rate_kbit: float,
        direction: str,
    ) -> dict[str, Any]:
        """Latency, jitter, loss and a bandwidth cap on `node`'s link (tc netem and tbf, Chaos
        Mesh NetworkChaos's delay/loss/bandwidth); undo: restore_network."""
        raise self._unsupported("degrade_network")

    def restore_network(self, node: str) -> None:
        """Undo degrade_network. Idempotent."""
        return  # where the fault cannot be injected there is nothing to undo

    def _unsupported(self, fault: str) -> InvalidInput:
        reason = self.info().unsupported.get(fault, "not implemented for this kind of target")
        return InvalidInput(f"{fault}: the {type(self).__name__} cannot do it: {reason}")

    def verify(self, fault: str, details: dict[str, Any]) -> Verification:
        """Whether `fault`, injected with `details` (what its method returned), took effect:
        the target's `verify_<fault>` method, which looks at the target itself (process
        states, packet counters, qdiscs, cgroup counters, keys), waiting a few seconds where
        evidence needs traffic. A target without one says it cannot tell."""
        check = getattr(self, f"verify_{fault}", None)
        if check is None:
            return Verification(None, f"{type(self).__name__} has no check for {fault}")
        result: Verification = check(details)
        return result

    # -- readings ------------------------------------------------------------------------
    @abstractmethod
    def queue_depth(self) -> float:
        """Requests waiting in the engines (vLLM: sum of vllm:num_requests_waiting)."""

    @abstractmethod
    def healthy_workers(self, mode: str = "") -> int:
        """Workers answering ready, of `mode` (gpu, cpu; "" = any)."""

    def replicas(self) -> Replicas:
        """The GPU pool's desired and ready replicas. InvalidInput on targets that cannot
        tell."""
        raise InvalidInput(f"{type(self).__name__}: cannot read the GPU pool's replicas")

    def gateway_metrics(self, names: tuple[str, ...]) -> dict[str, float]:
        """Sum over the gateways of the samples of each metric of `names` on their /metrics
        (e.g. `service_degraded_total`), one read of each gateway for all of them; a gateway
        that does not answer counts for nothing. InvalidInput on targets whose gateways
        cannot be read."""
        raise InvalidInput(f"{type(self).__name__}: cannot read the gateways' metrics {names}")

    def gateway_metric(self, name: str) -> float:
        """`gateway_metrics` of one metric."""
        return self.gateway_metrics((name,))[name]

    def requests_taken(self) -> dict[str, float] | None:
        """Requests each worker's engine has taken so far, by worker name: those it finished
        (vLLM's vllm:request_success) plus those in it now (running and waiting); None when
        the target cannot read them."""
        return None

    def engine_stats(self) -> dict[str, float] | None:
        """The engines' KV-cache pressure now: {"kv_cache_usage_max" (0..1, the fullest
        engine), "preemptions_total", "waiting"} from vLLM's metrics; None when the target
        cannot read them."""
        return None

    def kv_cache_usage(self) -> float | None:
        """The fullest KV cache among the engines that export it (0..1; vLLM:
        vllm:kv_cache_usage_perc), None when none does."""
        return None

    def recovery_facts(self, since_ts: float) -> dict[str, Any] | None:
        """How the target's parts came back after `since_ts`, in Krkn's terms (its pod
        recovery times): {"recovered": [...], "unrecovered": [...]}, each entry with `name`,
        `node`, `rescheduling_time_s` (death until restarted), `readiness_time_s` (restarted
        until ready) and `total_recovery_time_s`. None when the target cannot tell."""
        return None

    def plan_load_workers(self, qps: float) -> LoadWorkersPlan | None:
        """The load workers this target runs itself for a rate of `qps` (a cluster's own
        Locust workers, for rates beyond the runner's machine), known before they are started
        (the ledger's order); None when the run's machine sends the whole rate."""
        return None

    def run_load_workers(self, qps: float) -> dict[str, Any]:
        """Start the load workers `plan_load_workers` named; returns what was started."""
        raise InvalidInput(f"{type(self).__name__}: this target runs no load workers")

    def undo(self, op: str, args: dict[str, Any]) -> None:
        """Run undo operation `op`; raises InvalidInput for anything not in UNDO_OPS."""
        if op not in self.UNDO_OPS:
            known = ", ".join(sorted(self.UNDO_OPS))
            raise InvalidInput(f"undo: unknown operation {op!r}; expected one of {known}")
        getattr(self, op)(**args)


@dataclass(frozen=True)
class CleanupRequest:
    """What `llmchaos cleanup` was asked."""

    state_root: Path | None = None
    """Where the embedded stacks' state folders are; None: the default (each kind reads what
    concerns it)."""
    names: tuple[str, ...] = ()
    """Things named explicitly (`--stack ID`, and the stacks of runs named with `--run`):
    removed whatever their owner."""
    everything: bool = False
    dry_run: bool = False


class TargetKind(ABC):
    """One kind of target: its settings, planning, opening and cleanup (see the module doc).

    Subclasses set `name`, `settings_type` and `prefix` (of their configuration keys and,
    upper-cased after LLMCHAOS_, their environment variables)."""

    name: ClassVar[str]
    settings_type: ClassVar[type[TargetSettings]]
    prefix: ClassVar[str] = ""

    def settings(
        self, configuration: Mapping[str, Any], environ: Mapping[str, str]
    ) -> TargetSettings:
        """This kind's settings from the experiment's configuration and the environment;
        raises InvalidInput naming the key. `variant` has no prefix: every experiment names
        it the same way, whatever its target (the suites pass `--var variant=...`)."""
        variant = build_settings(_Variant, configuration, environ).variant
        settings = build_settings(
            self.settings_type,
            configuration,
            environ,
            prefix=self.prefix,
            extra={"variant": variant},
        )
        self.check_variant(settings)
        return settings

    def keys(self) -> set[str]:
        """Configuration keys the settings read."""
        return settings_keys(self.settings_type, self.prefix) - {self.prefix + "variant"} | {
            "variant"
        }

    def from_record(self, data: dict[str, Any]) -> TargetSettings:
        """Settings as `to_record` wrote them."""
        return settings_from_record(self.settings_type, data, "target_settings")

    def variants(self, settings: TargetSettings) -> tuple[str, ...]:
        """Names of this target's variants: the default first, then the known-bad ones."""
        return (DEFAULT_VARIANT,)

    def check_variant(self, settings: TargetSettings) -> None:
        known = self.variants(settings)
        if settings.variant not in known:
            raise InvalidInput(
                f"variant: unknown variant {settings.variant!r}; expected one of: "
                f"{', '.join(known)}"
            )

    def max_qps(self, settings: TargetSettings) -> float | None:
        """Highest rate a run sends to this target whatever it asks, None for no cap."""
        return None

    def sized_for(
        self, settings: TargetSettings, qps: float, traffic: TrafficSpec
    ) -> TargetSettings:
        """The settings of a target laid out for `qps` of `traffic` (the rate the run will
        send), when the settings ask for that; unchanged by default. Raises InvalidInput
        when this machine cannot hold that target."""
        return settings

    def max_qps_source(self, settings: TargetSettings) -> str:
        """Where that cap is set, for the run's note when it caps a rate."""
        return "the target's settings"

    def layout_notes(self, settings: TargetSettings, qps: float, traffic: TrafficSpec) -> list[str]:
        """What the run should say about a layout that cannot carry `qps` of `traffic` (the
        rate it will send): the target runs it all the same. None to say by default."""
        return []

    def prepare(self, settings: TargetSettings, progress: Callable[[str], None]) -> bool:
        """Measure, before a run, what this target's defaults depend on when it is not known
        yet (the embedded stack: this machine's rate); True when something was measured, so
        settings built before must be built again. Nothing by default."""
        return False

    def calibration(
        self,
        settings: TargetSettings,
        *,
        measure: Literal["if-missing", "again", "never"],
        progress: Callable[[str], None],
    ) -> str | None:
        """The rate this machine sustains against this target, described (`llmchaos
        calibrate`): the cached one, measured when missing or `again`; None when `never` and
        none is cached. Raises InvalidInput for a kind that is not calibrated."""
        raise InvalidInput(f"target {self.name}: nothing to calibrate (it sets no default cap)")

    @abstractmethod
    def plan(self, settings: TargetSettings) -> TargetInfo:
        """The names the target will have, before anything is started or changed (pre-flight:
        raises InvalidInput for what cannot work here)."""

    @abstractmethod
    def open(self, settings: TargetSettings, owner: Owner) -> Target:
        """Start the target or connect to it, for a run owned by `owner`."""

    def reattach(self, settings: TargetSettings, record: dict[str, Any]) -> Target:
        """The target of a dead run again, from its `record()`, to undo its faults."""
        raise InvalidInput(f"target {self.name}: cannot reattach to a dead run's target")

    def finish_dead_run(
        self, settings: TargetSettings, record: dict[str, Any], ledger: FaultLedger
    ) -> list[str]:
        """Close a killed run's open faults; one line per fault."""
        target = self.reattach(settings, record)
        try:
            return ledger.undo_all(lambda undo: target.undo(undo.op, undo.args), by="cleanup")
        finally:
            target.close()

    def remove_run_target(self, settings: TargetSettings, record: dict[str, Any]) -> list[str]:
        """Remove what one run's target left on this machine, whatever its owner (`cleanup
        --run ID`); one line per thing. Nothing for targets the run did not start."""
        return []

    def cleanup(self, request: CleanupRequest) -> list[str]:
        """Remove what dead owners of this kind left on this machine; one line per thing
        removed or left alone."""
        return []
