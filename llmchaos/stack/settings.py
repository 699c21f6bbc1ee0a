"""Typed settings of the embedded stack's processes.

The stack (`llmchaos.stack.stack`) builds these from `StackConfig` and the variant, writes each
process's settings as JSON into the stack's state folder, and the process reads them back with
`load_settings`. One object per process kind, every field with a default and the reason for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from llmchaos.errors import InvalidInput

__all__ = [
    "CPU_PROFILE",
    "GPU_PROFILE",
    "REDIS_PASSWORD_ENV",
    "CacheSettings",
    "DegradationSettings",
    "DiscoverySettings",
    "EngineProfile",
    "GatewaySettings",
    "UpstreamWorker",
    "WorkerSettings",
    "load_settings",
    "run_loop_process",
    "settings_from_dict",
    "settings_to_dict",
    "write_settings",
]

REDIS_PASSWORD_ENV = "LLMCHAOS_REDIS_PASSWORD"
"""Environment variable that hands a gateway the token cache's password."""

ServingMode = Literal["gpu", "cpu"]


@dataclass(frozen=True)
class EngineProfile:
    """Cost model of a continuous-batching engine (one simulated accelerator or CPU)."""

    mode: ServingMode = "gpu"
    """Which serving mode this engine represents; reported as `X-Serving-Mode` by the gateway."""
    max_num_seqs: int = 256
    """Most sequences in one running batch (vLLM `--max-num-seqs`, default 256)."""
    kv_cache_tokens: int = 200_000
    """KV-cache budget in tokens; running sequences are preempted when it runs out."""
    max_model_len: int = 8192
    """Context window: prompt + max_tokens above this -> 400 context_length_exceeded. Must not
    exceed `kv_cache_tokens`, or a lone sequence could never fit (vLLM refuses to start too)."""
    max_num_batched_tokens: int = 8192
    """Most prompt tokens prefilled in one step (vLLM `--max-num-batched-tokens`); a burst of
    prompts spreads over several steps so the running batch is not stalled for long. A single
    longer prompt is still admitted alone."""
    api_overhead_ms: float = 45.0
    """Per-request latency before the scheduler sees a request (tokenization and hand-off from
    the API server, a separate process in vLLM V1). It lengthens TTFT without holding the batch,
    which is why it is not part of the prefill step cost."""
    prefill_base_ms: float = 20.0
    """Fixed cost of a step that prefills (bigger kernels and sampling for the new sequences);
    with the API overhead a 16-token prompt sees TTFT ~66 ms at low load."""
    prefill_ms_per_token: float = 0.02
    """Prefill cost per prompt token (50k tokens/s); TTFT is 60-120 ms for prompts up to ~2,700
    tokens at low load, ~160 ms at 4,600."""
    decode_base_ms: float = 11.0
    """Decode step cost with one sequence: the per-output-token latency at low load."""
    decode_ms_per_seq: float = 0.04
    """Extra step cost per decoding sequence (batch size grows the step): 21 ms at 256."""
    load_s: float = 3.0
    """Model-load time at every restart; /healthz answers 503 `loading` meanwhile."""
    first_load_s: float | None = None
    """Model-load time at the first start; None: `load_s`. A chaos run sets it short so the
    stack comes up fast, while a killed worker still takes the full `load_s` to come back."""
    gpu_memory_mib: int = 40_960
    """Memory the process shows in /gpu/processes (nvidia-smi `used_memory`)."""


GPU_PROFILE = EngineProfile()
"""Calibrated to published 7-8B numbers on one A100-class GPU: TTFT 60-120 ms, 10-15 ms/token."""

CPU_PROFILE = EngineProfile(
    mode="cpu",
    max_num_seqs=16,
    kv_cache_tokens=40_000,
    # 10x the GPU's costs; the fixed part of TTFT is mostly in the API overhead, which does
    # not hold the batch, so a CPU pool under steady arrivals still decodes (a 600 ms prefill
    # base would stall every step that admits a request)
    api_overhead_ms=450.0,
    prefill_base_ms=200.0,
    prefill_ms_per_token=0.2,
    decode_base_ms=110.0,
    decode_ms_per_seq=2.0,
    load_s=1.0,
    gpu_memory_mib=0,
)
"""About ten times slower than the GPU profile, with a small batch: the fallback pool."""


@dataclass(frozen=True)
class WorkerSettings:
    """One engine worker process (an OpenAI-compatible server over one simulated engine)."""

    name: str = "gpu-0"
    """Worker name, unique in the stack (gpu-0, gpu-1, cpu-0)."""
    node: str = "node-a"
    """Node the worker runs on."""
    host: str = "127.0.0.1"
    """Address to bind; a node's namespace address when nodes are network namespaces."""
    port: int = 8000
    """Port to bind."""
    model: str = "llmchaos-7b"
    """Model name served; others -> 404 model_not_found."""
    profile: EngineProfile = GPU_PROFILE
    """Engine cost model."""
    gpu_index: int = 0
    """Index of the simulated GPU the worker holds, shown in /gpu/processes (mode gpu only)."""
    shutdown_drain_s: float = 1.5
    """After SIGTERM, how long the requests in flight get to answer before they are aborted:
    a pod's terminationGracePeriodSeconds (30 s by default), scaled to this simulator's
    answers of about a second, and under the 2 s after which the node agent (a scale-in, a
    stack going down) kills. 0: abort at once."""


@dataclass(frozen=True)
class CacheSettings:
    """Token cache in front of the SQLite token table."""

    ttl_s: float = 300.0
    """TTL of a cached valid token."""
    ttl_jitter_s: float = 30.0
    """Uniform random extra TTL in [0, jitter] so tokens cached together do not expire together."""
    negative_ttl_s: float = 60.0
    """TTL of a cached 'unknown or revoked token' answer; 0 disables negative caching."""
    coalesce_misses: bool = True
    """Concurrent misses for one token share one SQLite lookup."""


@dataclass(frozen=True)
class DegradationSettings:
    """When a gateway degrades and what it does then (gateway/degradation.py; the rules are
    the seed's: queue_depth_threshold 500 at once, latency_p99_ms 800 for 2 minutes)."""

    queue_rule: bool = True
    """Degrade at once when the engines' queue passes `queue_depth_threshold`. Off (variant
    `late-degradation`): only the latency rule, which fires minutes late or never."""
    queue_depth_threshold: int = 500
    """Sum of the engines' vllm:num_requests_waiting above which the gateway degrades."""
    latency_p99_ms: float = 800.0
    """P99 of the engines' vllm:e2e_request_latency_seconds (requests finished within
    `latency_window_s`) above which, for `latency_for_s`, the gateway degrades."""
    latency_for_s: float = 120.0
    """How long the P99 must stay over `latency_p99_ms` (the seed: 2 minutes); scale it down
    for short runs."""
    latency_window_s: float = 10.0
    """The P99's window: requests finished within this many seconds."""
    poll_interval_s: float = 0.5
    """How often the gateway reads the engines' /metrics: the queue rule fires at most this
    late (plus one scrape)."""
    recover_queue_ratio: float = 0.5
    """Degraded mode ends once the queue is at most this share of the threshold..."""
    hold_s: float = 10.0
    """...and the P99 under its limit, for this long (so it does not flap)."""
    degraded_max_tokens: int = 32
    """What degraded answers are cut to: max_tokens (and max_completion_tokens) above it
    become it, so each request holds an engine slot for fewer decode steps and the queue
    drains; answers say `X-Degraded: true`."""


@dataclass(frozen=True)
class DiscoverySettings:
    """Where a gateway finds its workers (gateway/discovery.py): its settings' `workers`, or,
    with `endpoints`, the registry."""

    endpoints: tuple[str, ...] = ()
    """The registry members' client URLs (etcd); () = the static `workers`."""
    prefix: str = "/llmchaos/workers/"
    """Key prefix under which the registrar keeps the stack's ready workers."""
    interval_s: float = 0.25
    """How often the gateway reads the registry: a new worker is routed to within this (and
    one health check), and an election (about 1 s) is seen by several reads."""
    timeout_s: float = 0.5
    """One read of one member; a partitioned member times out in this."""
    keep_last_known: bool = True
    """When no member answers: go on with the workers last found (hardened), or drop them
    (variant `no-endpoint-cache`)."""


@dataclass(frozen=True)
class UpstreamWorker:
    """A worker as the gateway sees it."""

    name: str
    """Worker name (gpu-0 ...)."""
    url: str
    """Base URL, e.g. http://10.203.1.2:8000."""
    mode: ServingMode
    """gpu workers serve first; cpu workers only when no gpu worker can take the request."""
    node: str = ""
    """Node the worker runs on (for logs and metrics)."""


@dataclass(frozen=True)
class GatewaySettings:
    """One API gateway process (primary or backup)."""

    name: str = "gateway-primary"
    """Gateway name, unique in the stack."""
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 9000
    """Port to bind."""
    models: tuple[str, ...] = ("llmchaos-7b",)
    """Models offered at /v1/models; a request for another -> 404 model_not_found."""
    workers: tuple[UpstreamWorker, ...] = ()
    """Upstream engine workers."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Token cache, without credentials: its password comes from the environment
    (REDIS_PASSWORD_ENV), so that no file of the stack holds it."""
    token_db_path: str = "tokens.sqlite"
    """SQLite token table (tokens(token TEXT PRIMARY KEY, tenant TEXT, revoked INTEGER))."""
    token_db_pool_size: int = 4
    """SQLite connections; a cache miss waits for one, as with a real database's pool."""
    token_db_latency_ms: float = 5.0
    """Added to each SQLite lookup, standing in for the round trip to a networked database."""
    cache: CacheSettings = field(default_factory=CacheSettings)
    """Token cache behaviour (the hardened defaults; variants weaken it)."""
    cpu_fallback: bool = True
    """Serve from cpu workers when no gpu worker can take a request; off -> 503."""
    failover: bool = True
    """Route around bad workers: skip those failing active checks (dead, loading, partitioned)
    or ejected after a failed request, and retry on another one. Off -> round-robin over every
    gpu worker whatever its health, no retry: a Kubernetes Service without readiness probes
    (health is still checked, for metrics and logs only). Default on."""
    queue_shed_threshold: int = 1000
    """Shed with 429 + Retry-After when the estimated queue (requests beyond the workers'
    running batches) is over this: the last line, twice the degradation threshold, so the
    gateway first degrades (shorter answers) and sheds only what that does not absorb."""
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    """Static workers, or the registry's (with `discovery.endpoints`)."""
    degradation: DegradationSettings = field(default_factory=DegradationSettings)
    """When to degrade and how (None of it when `degradation.queue_rule` is off and the
    latency rule never holds long enough)."""
    health_interval_s: float = 1.0
    """Active health check period per worker (GET /healthz)."""
    health_timeout_s: float = 0.5
    """Timeout of one active health check; 0: none (the `no-health-timeout` variant: a hung
    worker's check never ends, so it keeps its last verdict, healthy)."""
    health_timeouts_to_fail: int = 2
    """Consecutive active-check timeouts before a worker counts as down (a refusal or a
    not-ready answer counts at once): one timeout can be the gateway's own event-loop lag in a
    burst, and would take every worker out at the same moment."""
    eject_s: float = 5.0
    """Passive health: a worker that failed a request is skipped this long, times the number of
    times in a row it was ejected for a bad answer (Envoy's outlier detection). An active check
    that passes readmits it early only when it was ejected for not answering (a connect error
    or a timeout): a worker that answered 500 or broke a stream while its /healthz says ready
    is a gray failure its health check cannot see."""
    passive_ejection: bool = True
    """Eject workers on failed requests (passive health). Off: the `no-passive-ejection`
    variant, where only the active checks judge a worker, so one that passes them while it
    fails inference keeps its share of the traffic."""
    max_ejection_ratio: float = 1.0
    """At most this share of a mode's workers may be out (ejected or failing its checks)
    after an ejection for a gray failure (a bad answer, a timeout while its checks pass, a
    lost hedge): Envoy's max_ejection_percent. 1.0 (no cap) by default: in kv_cache_surge,
    capping at 0.5 kept a GPU slowed by the surge in and its P99 over the SLO past the SLA
    (not recovered in 5 runs of 5), while ejecting both GPUs recovered in 11.5 s through the
    CPU fallback and shedding. A dead worker is ejected whatever the share."""
    round_robin: bool = False
    """Spread requests in turn over the healthy workers instead of to the one with the fewest
    outstanding: the `round-robin` variant, blind to a worker that is slow without failing."""
    connect_timeout_s: float = 1.0
    """Upstream connect timeout; a partitioned node shows as a connect timeout."""
    first_byte_timeout_s: float = 6.0
    """Upstream timeout until response headers; below the clients' 8 s."""
    max_retries: int = 1
    """Retries on another worker when nothing was sent to the client yet."""
    hedge_after_s: float = 1.5
    """A request whose worker has sent nothing back after this long (a plain answer, or a
    stream's first chunk) is sent to a second worker too; the first answer goes to the client
    and the other attempt is cancelled (hedged requests, "The Tail at Scale", Dean & Barroso
    2013; Envoy's and gRPC's hedging policies). It bounds what a slow worker (a degraded link,
    a throttled CPU: gray failures its health checks pass) costs the tail. Above the P99 of a
    healthy worker's first answer under load (0.5-1 s here). 0: off. Only with `failover`."""
    hedge_max_prompt_tokens: int = 2048
    """Longer prompts are never hedged: their prefill is the costliest work there is and
    slow by nature, and twins of them doubled the KV-cache pressure of a long-prompt surge
    (kv_cache_surge, not recovered with them hedged)."""
    hedge_budget_ratio: float = 0.1
    """At most this share of the requests is hedged (a token bucket refilled by each request,
    as gRPC's retry throttling), so a pool that is slow everywhere is not sent twice the load."""
    stream_idle_timeout_s: float = 10.0
    """Longest silence from a worker once its response has started; above the clients' 8 s so
    a slow stream is the client's call, but a worker that stalls mid-body is not held forever."""
    worker_queue_allowance_ratio: float = 0.5
    """A gpu worker is at capacity at max_num_seqs * (1 + ratio) outstanding requests: up to
    half a batch may wait in its queue (about half a request's time) before traffic spills to
    cpu."""
    cpu_queue_allowance_ratio: float = 0.0
    """The same for cpu workers: none. A cpu request takes seconds, so one queued behind a
    full cpu batch would wait past the clients' timeout; beyond the batch the gateway sheds."""
    cpu_spill_max_tokens: int = 32
    """While a gpu worker is healthy, only requests for at most this many output tokens
    (max_tokens, else the endpoint's default) spill to a cpu worker when the gpu workers are
    full; longer ones wait on a full gpu worker. A cpu worker's full batch takes ~5.3 s for 32
    tokens and ~9.8 s for 64 (CPU_PROFILE, ~140 ms a token): past `first_byte_timeout_s` (6 s),
    so a 64-token spill timed out there and its retry ended past the clients' 8 s, while a
    full gpu worker's queue costs about a second. With no healthy gpu worker the cpu workers
    take every length: there is nothing faster to wait for."""
    retry_after_s: int = 1
    """`Retry-After` of a 429 when shedding: one second is about one GPU request's duration."""
    redis_timeout_s: float = 1.0
    """Connect and command timeout towards Redis; past it the lookup falls back to SQLite. It
    counts event-loop lag too, so it stays above what a burst causes (0.25 s was exceeded in
    a 200-request burst): a busy gateway must not take itself for a Redis outage."""
    redis_retry_s: float = 1.0
    """After a Redis error, go straight to SQLite this long instead of paying the timeout on
    every request."""


_T = TypeVar("_T")


def settings_to_dict(settings: Any) -> dict[str, Any]:
    """Plain-JSON dict of a settings dataclass (nested dataclasses included)."""
    return dataclasses.asdict(settings)


def settings_from_dict(cls: type[_T], data: dict[str, Any], where: str = "settings") -> _T:
    """Build dataclass `cls` from `data`, recursing into nested dataclasses and tuples.

    Raises InvalidInput naming `where` and the field for unknown fields or wrong types.
    """
    if not isinstance(data, dict):
        raise InvalidInput(f"{where}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise InvalidInput(
            f"{where}: unknown field(s) {', '.join(unknown)}; known: {sorted(names)}"
        )
    kwargs = {name: _coerce(hints[name], value, f"{where}.{name}") for name, value in data.items()}
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return settings_from_dict(hint, value, where)  # type: ignore[arg-type]
    if origin is tuple:
        (item_hint, *_rest) = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            raise InvalidInput(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(item_hint, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise InvalidInput(f"{where}: expected one of {typing.get_args(hint)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        # an optional dataclass (`RegistryInfo | None`) is read back as one
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg) and isinstance(value, dict):
                return settings_from_dict(arg, value, where)  # type: ignore[arg-type]
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(hint, type) and not isinstance(value, hint):
        raise InvalidInput(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def write_settings(settings: Any, path: Path) -> Path:
    """Write `settings` as JSON to `path` (atomically) and return the path."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(settings_to_dict(settings), indent=2))
    tmp.replace(path)
    return path


def load_settings(cls: type[_T], path: Path) -> _T:
    """Read settings of type `cls` written by `write_settings`."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"{path}: cannot read settings: {exc}") from exc
    return settings_from_dict(cls, data, str(path))


class _Loop(Protocol):
    stopping: bool

    def run(self) -> int: ...


_L = TypeVar("_L", bound=_Loop)


def run_loop_process(
    name: str,
    cls: type[_T],
    build: Callable[[_T], _L],
    started: Callable[[_L], str],
    argv: list[str] | None = None,
) -> int:
    """The main of a stack process that runs one loop from its settings file until SIGTERM or
    SIGINT (`python -m llmchaos.stack.<name> --settings FILE`): exit 2 with one line when the
    settings cannot be used, else the loop's own exit code. `started` says what it runs."""
    parser = argparse.ArgumentParser(prog=f"python -m llmchaos.stack.{name}")
    parser.add_argument("--settings", type=Path, required=True, help=f"{cls.__name__} JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    try:
        loop = build(load_settings(cls, args.settings))
    except (InvalidInput, OSError, ValueError) as exc:
        print(f"llmchaos {name}: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum: int, _frame: types.FrameType | None) -> None:
        loop.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logging.getLogger(f"llmchaos.{name}").info("%s", started(loop))
    return loop.run()
