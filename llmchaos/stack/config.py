"""What to start: `StackConfig`, and the variants of the target (hardened and known-bad ones).

A known-bad variant removes exactly one protection, so that the experiment testing that
protection can be shown to fail against it (a probe that cannot fail proves nothing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from llmchaos.errors import InvalidInput
from llmchaos.stack.settings import (
    CacheSettings,
    DegradationSettings,
    EngineProfile,
    GatewaySettings,
)

__all__ = [
    "DEFAULT_VARIANT",
    "MAX_ACTIVE_GATEWAYS",
    "MAX_CPU_WORKERS",
    "MAX_GPUS_PER_NODE",
    "MAX_GPU_WORKERS",
    "VARIANTS",
    "DiscoveryMode",
    "NetnsMode",
    "StackConfig",
    "Variant",
    "get_variant",
]

NetnsMode = Literal["auto", "on", "off"]
DiscoveryMode = Literal["static", "etcd"]

# What one machine runs: each worker and gateway is a Python process, and each node a network
# namespace whose /30 and link numbers must stay below the registry's (netns.py: 21 nodes).
# 32 GPU workers: the fleet for 1,400 QPS (16 nodes of 2); an idle worker costs ~0.01 of a
# core (health checks, the gateways' scrapes) and 31 MiB, measured with 33 workers up.
MAX_GPU_WORKERS = 32
MAX_CPU_WORKERS = 20
MAX_GPUS_PER_NODE = 8
"""A DGX-like node."""
MAX_ACTIVE_GATEWAYS = 8


@dataclass(frozen=True)
class Variant:
    """A flavour of the reference stack."""

    name: str
    """Name used on the command line and in experiments (`--variant`)."""
    description: str
    """One line for `llmchaos stack up --help` and reports."""
    cache: CacheSettings = field(default_factory=CacheSettings)
    """Token cache behaviour of the gateways."""
    cpu_fallback: bool = True
    """Whether gateways fall back to CPU workers when no GPU worker can serve."""
    backup_gateway: bool = True
    """Whether HAProxy has a backup gateway to fail over to."""
    failover: bool = True
    """Whether gateways route around dead, loading or partitioned workers and retry elsewhere."""
    degradation_queue_rule: bool = True
    """Whether gateways degrade at once when the engines' queue passes its threshold (off:
    only after the P99 has stayed high for minutes)."""
    autoscaler: bool = True
    """Whether the autoscaler runs when the stack is asked to autoscale (`autoscale`)."""
    endpoint_cache: bool = True
    """Whether gateways that find their workers in the registry keep serving the last ones
    found when it cannot be read."""
    health_check_timeout: bool = True
    """Whether the gateways' active health checks have a timeout (else a hung worker's check
    never ends, and the worker stays healthy in their eyes)."""
    passive_ejection: bool = True
    """Whether gateways eject a worker whose requests fail (5xx, broken streams, timeouts)."""
    round_robin: bool = False
    """Whether gateways spread requests in turn instead of to the least outstanding worker."""
    hedging: bool = True
    """Whether gateways hedge a request its worker sits on (`hedge_after_s`)."""
    gpu_kv_cache_tokens: int | None = None
    """KV-cache budget of the GPU workers; None: the GPU profile's."""

    def gateway_settings(self, base: GatewaySettings) -> GatewaySettings:
        """`base` with this variant's gateway behaviour applied."""
        return dataclasses.replace(
            base,
            cache=self.cache,
            cpu_fallback=self.cpu_fallback,
            failover=self.failover,
            degradation=dataclasses.replace(
                base.degradation, queue_rule=self.degradation_queue_rule
            ),
            discovery=dataclasses.replace(base.discovery, keep_last_known=self.endpoint_cache),
            health_timeout_s=base.health_timeout_s if self.health_check_timeout else 0.0,
            passive_ejection=self.passive_ejection,
            round_robin=self.round_robin,
            hedge_after_s=base.hedge_after_s if self.hedging else 0.0,
        )

    def gpu_profile(self, base: EngineProfile) -> EngineProfile:
        """`base` (the GPU profile) with this variant's engine sizing applied."""
        if self.gpu_kv_cache_tokens is None:
            return base
        return dataclasses.replace(base, kv_cache_tokens=self.gpu_kv_cache_tokens)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "hardened",
            "all protections on: TTL jitter, negative caching, coalesced misses, worker "
            "failover, CPU fallback, backup gateway",
        ),
        Variant(
            "naive-cache",
            "token cache with a fixed TTL, no negative caching and no miss coalescing",
            cache=CacheSettings(ttl_jitter_s=0.0, negative_ttl_s=0.0, coalesce_misses=False),
        ),
        Variant(
            "no-cpu-fallback",
            "gateways answer 503 instead of serving from CPU workers when no GPU is left",
            cpu_fallback=False,
        ),
        Variant(
            "no-backup-gateway",
            "HAProxy has only the primary gateway: a gateway crash is an outage",
            backup_gateway=False,
        ),
        Variant(
            "late-degradation",
            "gateways lack the queue-depth trigger: they degrade only after the engines' P99 "
            "has stayed over 800 ms for 2 minutes, late or never, and ride out an overload "
            "with nothing but their queues (no hedging)",
            degradation_queue_rule=False,
            # hedges rescued some of its queued requests and blurred the overload it stands
            # for (compare's late stack timed out about as often as the hardened one, twice)
            hedging=False,
        ),
        Variant(
            "no-autoscaler",
            "the GPU pool stays at its minimum replicas whatever the load (the HPA is off)",
            autoscaler=False,
        ),
        Variant(
            "no-endpoint-cache",
            "gateways that find their workers in the registry drop them whenever it cannot be "
            "read (503 until it answers again)",
            endpoint_cache=False,
        ),
        Variant(
            "no-failover",
            "gateways spread requests over every GPU worker, dead, loading or partitioned, and "
            "never retry: a Service without readiness probes",
            failover=False,
        ),
        Variant(
            "no-health-timeout",
            "gateways' active health checks have no timeout: a hung worker's check never ends "
            "and it stays healthy; only requests timing out (6 s) eject it, for 5 s each time",
            health_check_timeout=False,
        ),
        Variant(
            "no-passive-ejection",
            "gateways never eject a worker for failed requests: one whose health check passes "
            "while its GPU fails (Xid) keeps its share of the traffic",
            passive_ejection=False,
        ),
        Variant(
            "round-robin",
            "gateways spread requests in turn over the healthy workers instead of to the one "
            "with the fewest outstanding, and never hedge: a slow GPU keeps half of the traffic",
            round_robin=True,
            hedging=False,
        ),
        Variant(
            "round-robin-no-health-timeout",
            "gateways route in turn like a default nginx upstream: no fewest-outstanding "
            "choice, no hedging, and health checks without a timeout, so a hung worker keeps "
            "its turn (1 request in 24 on a 1,000-QPS fleet) until those requests time out "
            "(6 s) and eject it for 5 s",
            round_robin=True,
            hedging=False,
            health_check_timeout=False,
        ),
        Variant(
            "small-kv-cache",
            "GPU workers with a fifth of the KV cache (40,000 tokens: a too low "
            "--gpu-memory-utilization): a long-prompt surge preempts and queues",
            gpu_kv_cache_tokens=40_000,
        ),
    )
}
DEFAULT_VARIANT = "hardened"


def get_variant(name: str) -> Variant:
    """The variant called `name`; raises InvalidInput listing the known ones."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise InvalidInput(
            f"unknown variant {name!r}; expected one of: {', '.join(VARIANTS)}"
        ) from None


@dataclass(frozen=True)
class StackConfig:
    """Everything `llmchaos stack up` can be told. Defaults give the reference topology:
    node-a (gpu-0), node-b (gpu-1), node-c (cpu-0), a primary and a backup gateway behind
    HAProxy on :8800. A fleet sized from a rate (llmchaos.stack.fleet) sets `gpu_workers`,
    `gpus_per_node`, `cpu_workers` and `active_gateways`: e.g. 2 per node gives node-a
    (gpu-0, gpu-1), node-b (gpu-2, gpu-3), ..., and the CPU node after them."""

    variant: str = DEFAULT_VARIANT
    """Name of a `Variant` in VARIANTS."""
    netns: NetnsMode = "auto"
    """Nodes as network namespaces: on (needs root), off (loopback), auto (on when root)."""
    gpu_workers: int = 2
    """GPU workers, `gpus_per_node` per node (node-a, node-b, ...), named gpu-0, gpu-1, ...
    in node order (at most MAX_GPU_WORKERS)."""
    gpus_per_node: int = 1
    """GPU workers per node (1..8). A node is one namespace, its agent and these workers: a
    partition or a node's crash takes all of them at once. The last GPU node holds the rest
    when `gpu_workers` is not a multiple."""
    cpu_workers: int = 1
    """CPU fallback workers, all on the node after the GPU nodes (node-c by default; at most
    20)."""
    active_gateways: int = 1
    """Gateways HAProxy spreads requests over (least connections), 1..8: gateway-primary,
    then gateway-primary-2, ... The variant's backup gateway (gateway-backup) comes on top and
    serves only when every active one is down."""
    port: int = 8800
    """HAProxy's front port on 127.0.0.1 (the gateway URL); 0 picks a free one."""
    model: str = "llmchaos-7b"
    """The one model the stack serves."""
    gpu_load_s: float = 3.0
    """Model-load time of a GPU worker at every (re)start: the not-ready gap after a kill.
    Kubernetes plus a real 7B model takes tens of seconds; locally a few keep runs short."""
    cpu_load_s: float = 1.0
    """Model-load time of a CPU worker."""
    first_load_s: float | None = None
    """Model-load time at a worker's first start, when shorter than its restarts' (None: the
    same). Chaos runs use it so the stack comes up fast while a killed worker still takes
    gpu_load_s to come back."""
    restart_delay_s: float = 0.5
    """How long a node agent waits before restarting a process that died (kubelet backoff)."""
    tenants: int = 8
    """Tenants seeded in the token table."""
    tokens_per_tenant: int = 4
    """Valid tokens per tenant."""
    revoked_tokens: int = 4
    """Revoked tokens in the table (listed in the tokens file as revoked, for negative tests)."""
    token_db_latency_ms: float = 5.0
    """Added to every token-table lookup: the round trip to a networked database."""
    token_db_pool_size: int = 4
    """Token-table connections per gateway: what a cache stampede queues on."""
    queue_shed_threshold: int = GatewaySettings.queue_shed_threshold
    """Gateways shed with 429 above this many queued requests (they degrade first, at
    `degradation_queue_threshold`)."""
    gateway_first_byte_timeout_s: float = GatewaySettings.first_byte_timeout_s
    """Gateways' wait for a worker's response headers (GatewaySettings.first_byte_timeout_s)."""
    gateway_read_timeout_s: float = GatewaySettings.stream_idle_timeout_s
    """Gateways' wait on one read from a worker (GatewaySettings.stream_idle_timeout_s)."""
    gateway_hedge_after_s: float = GatewaySettings.hedge_after_s
    """Gateways' hedging delay (GatewaySettings.hedge_after_s); 0: no hedging."""
    degradation_queue_threshold: int = DegradationSettings.queue_depth_threshold
    """Gateways degrade (shorter answers, `X-Degraded`) when the engines' queue passes this."""
    degradation_latency_for_s: float = DegradationSettings.latency_for_s
    """How long the engines' P99 must stay over 800 ms before the gateways degrade (the
    seed's 2 minutes; shorter for short runs)."""
    discovery: DiscoveryMode = "static"
    """Where gateways find their workers: their settings (static), or a 3-member etcd
    registry (etcd) that a registrar keeps filled with the ready workers."""
    gpu_max_num_seqs: int | None = None
    """Running-batch size of the GPU workers (None: the GPU profile's 256); a small batch
    (a large model per GPU) saturates at a rate this machine can send."""
    autoscale: bool = False
    """Scale the GPU pool with the embedded autoscaler (HPA semantics): `gpu_workers` is then
    the most replicas (one node each), `autoscale_min_replicas` run at first."""
    autoscale_min_replicas: int = 1
    autoscale_target_utilization: float = 0.7
    """Average (running + waiting) / max_num_seqs of a replica the autoscaler aims at."""
    autoscale_sync_s: float = 15.0
    """How often the autoscaler decides (the HPA's 15 s)."""
    autoscale_scale_down_window_s: float = 300.0
    """Scale-down stabilisation window (the HPA's 300 s)."""
    autoscale_policy_period_s: float = 15.0
    """Period of the scale-up (4 pods or 100%) and scale-down (100%) rate limits."""
    state_root: Path = Path("reports/stacks")
    """Folder holding one state folder per stack (topology, settings, logs, data)."""
    ready_timeout_s: float = 60.0
    """Deadline for each component to report ready."""

    def __post_init__(self) -> None:
        get_variant(self.variant)
        if self.netns not in ("auto", "on", "off"):
            raise InvalidInput(f"netns: expected auto, on or off, got {self.netns!r}")
        if self.discovery not in ("static", "etcd"):
            raise InvalidInput(f"discovery: expected static or etcd, got {self.discovery!r}")
        for name, low in (
            ("gpu_workers", 0),
            ("cpu_workers", 0),
            ("gpus_per_node", 1),
            ("active_gateways", 1),
            ("tenants", 1),
            ("token_db_pool_size", 1),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise InvalidInput(f"{name}: expected an integer >= {low}, got {value!r}")
        if self.gpu_workers + self.cpu_workers < 1:
            raise InvalidInput("gpu_workers + cpu_workers: expected at least one worker")
        for name, high in (
            ("gpu_workers", MAX_GPU_WORKERS),
            ("cpu_workers", MAX_CPU_WORKERS),
            ("gpus_per_node", MAX_GPUS_PER_NODE),
            ("active_gateways", MAX_ACTIVE_GATEWAYS),
        ):
            if getattr(self, name) > high:
                raise InvalidInput(f"{name}: expected at most {high}, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise InvalidInput(f"port: expected 0..65535, got {self.port}")
        for name in (
            "gpu_load_s",
            "cpu_load_s",
            "restart_delay_s",
            "token_db_latency_ms",
            "gateway_hedge_after_s",
        ):
            if getattr(self, name) < 0:
                raise InvalidInput(f"{name}: expected >= 0, got {getattr(self, name)}")
        for name in ("gateway_first_byte_timeout_s", "gateway_read_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidInput(f"{name}: expected > 0, got {getattr(self, name)}")
        if self.first_load_s is not None and self.first_load_s < 0:
            raise InvalidInput(f"first_load_s: expected >= 0, got {self.first_load_s}")
        if self.gpu_max_num_seqs is not None and not 1 <= self.gpu_max_num_seqs <= 4096:
            raise InvalidInput(f"gpu_max_num_seqs: expected 1..4096, got {self.gpu_max_num_seqs}")
        if self.autoscale and not 1 <= self.autoscale_min_replicas <= self.gpu_workers:
            raise InvalidInput(
                f"autoscale_min_replicas: expected 1..gpu_workers ({self.gpu_workers}, the "
                f"most replicas), got {self.autoscale_min_replicas}"
            )
