"""The settings of one chaos run: `RunSettings`, built from the experiment and the environment.

Where each value comes from, first match wins:

1. the experiment's `configuration` (after Chaos Toolkit resolved its `env` entries and
   `--var` overrides), under the field's name: `"qps": 5000`, `"sla_s": {"type": "env", ...}`;
2. the environment variable `LLMCHAOS_<FIELD>` (e.g. `LLMCHAOS_VARIANT=naive-cache`), for
   fields the experiment does not set;
3. the default below.

Kubernetes settings (`target: k8s`) are the fields of
`llmchaos.backends.kubernetes.KubernetesSettings`, given as configuration keys `k8s_<field>`
or environment variables `LLMCHAOS_K8S_<FIELD>` (e.g. LLMCHAOS_K8S_NAMESPACE,
LLMCHAOS_K8S_ALLOWED_NAMESPACES=llm-serving, LLMCHAOS_K8S_GATEWAY_URL).

Values from the environment are strings; they are converted to the field's type here, and a
value that does not convert is an InvalidInput naming the key, the value and what is expected.
A configuration key that is not a field but looks like one (`sla` for `sla_s`) is an error too:
a typo must not silently fall back to the default.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmchaos.analysis import SLO_ERROR_CLASSES
from llmchaos.errors import InvalidInput
from llmchaos.load.timeline import FAILURE_CLASSES
from llmchaos.stack.config import StackConfig, get_variant

__all__ = [
    "ENV_PREFIX",
    "ERROR_CLASSES",
    "K8S_PREFIX",
    "MAX_LOAD_PROCESSES",
    "QPS_PER_LOAD_PROCESS",
    "SETTING_RANGES",
    "Range",
    "RunSettings",
    "Target",
    "argument_ranges",
    "as_number",
]

ENV_PREFIX = "LLMCHAOS_"
K8S_PREFIX = "k8s_"
"""Configuration keys of the Kubernetes backend's settings (environment: LLMCHAOS_K8S_...)."""
Target = Literal["embedded", "k8s"]
ERROR_CLASSES = FAILURE_CLASSES
"""Failure classes the load counts: what `error_classes` may name."""


QPS_PER_LOAD_PROCESS = 2500.0
"""What one Locust process sends open loop here (llmchaos/load/README.md)."""
MAX_LOAD_PROCESSES = 64
"""Most load processes one machine runs (LoadConfig.workers allows 64)."""


@dataclass(frozen=True)
class Range:
    """The values a number may take: low..high, the low end itself excluded when open."""

    low: float
    high: float
    low_open: bool = False

    def __str__(self) -> str:
        if self.low_open:
            return f"> {_plain(self.low)} and <= {_plain(self.high)}"
        return f"within {_plain(self.low)}..{_plain(self.high)}"

    def check(self, where: str, value: object) -> float:
        """`value` as a number inside the range; raises InvalidInput naming `where`."""
        number = as_number(where, value)
        low_ok = number > self.low if self.low_open else number >= self.low
        if not (low_ok and number <= self.high):
            shown = _plain(value) if isinstance(value, int | float) else repr(value)
            raise InvalidInput(f"{where}: expected a number {self}, got {shown}")
        return number


def _plain(number: float) -> str:
    """1000000 as 1,000,000 and 0.5 as 0.5, never 1e+06."""
    if float(number).is_integer() and abs(number) < 1e15:
        return f"{int(number):,}"
    return f"{number:g}"


_DAY_S = 86400.0
SETTING_RANGES: dict[str, Range] = {
    "qps": Range(0, 1_000_000, low_open=True),
    "embedded_max_qps": Range(0, 20_000, low_open=True),
    "load_workers": Range(1, MAX_LOAD_PROCESSES),
    "gpu_workers": Range(0, 64),
    "cpu_workers": Range(0, 64),
    "gpu_load_s": Range(0, 3600),
    "first_load_s": Range(0, 3600),
    "restart_delay_s": Range(0, 600),
    "token_db_latency_ms": Range(0, 10_000),
    "token_db_pool_size": Range(1, 1000),
    "tenants": Range(1, 100_000),
    "stream_share": Range(0, 1),
    "output_median_tokens": Range(1, 32_768),
    "prompt_max_tokens": Range(10, 1_000_000),
    "bad_token_share": Range(0, 1),
    "request_timeout_s": Range(0, 3600, low_open=True),
    "warmup_s": Range(0, 3600),
    "max_duration_s": Range(0, 7 * _DAY_S, low_open=True),
    "p99_slo_ms": Range(0, 3_600_000, low_open=True),
    "ttft_slo_ms": Range(0, 3_600_000, low_open=True),
    "tpot_slo_ms": Range(0, 3_600_000, low_open=True),
    "error_rate_slo": Range(0, 1),
    "queue_depth_slo": Range(0, 1e9),
    "sla_s": Range(0, _DAY_S, low_open=True),
    "window_s": Range(0, 3600, low_open=True),
    "stable_for_s": Range(0, 3600, low_open=True),
    "recovery_timeout_s": Range(0, _DAY_S),
    "guard_error_rate": Range(0, 1),
    "guard_for_s": Range(0, _DAY_S, low_open=True),
}
"""Every number of RunSettings and the values it may take: a week of load at a million QPS
is the most any run may ask for; the embedded stack runs on one machine (20,000 QPS is four
times what the load itself sends from two cores)."""


def argument_ranges(settings: RunSettings) -> dict[str, Range]:
    """What probe and action arguments of these names may be, in a run with `settings`: a
    rate at most what a run may ask, durations and windows within the load's schedule."""
    longest_s = settings.max_duration_s
    return {
        "qps": SETTING_RANGES["qps"],
        "duration_s": Range(0, longest_s, low_open=True),
        "factor": Range(0, 100, low_open=True),
        "limit": Range(0, math.inf),
        "min_share": Range(0, 1),
        "window_s": Range(0, longest_s),
        "timeout_s": Range(0, longest_s),
        "ttl_s": Range(0, 30 * _DAY_S),
    }


@dataclass(frozen=True)
class RunSettings:
    """Everything one chaos run can be told; each field has a default and says why."""

    # -- the target ---------------------------------------------------------------------
    target: Target = "embedded"
    """embedded: the reference stack on this machine, started and stopped by the run.
    k8s: a cluster, through the Kubernetes backend (settings in `k8s`)."""
    variant: str = "hardened"
    """Embedded stack variant; known-bad ones (naive-cache, no-cpu-fallback,
    no-backup-gateway, no-failover) are the negative controls."""
    netns: Literal["auto", "on", "off"] = "auto"
    """Embedded nodes as network namespaces: auto = when root (partitions need it)."""
    gpu_workers: int = 2
    """Embedded GPU workers (node-a, node-b, ...)."""
    cpu_workers: int = 1
    """Embedded CPU fallback workers (on the node after the GPU nodes)."""
    gpu_load_s: float = 10.0
    """Embedded model-load time of a GPU worker after a restart: the not-ready gap a GPU kill
    opens. A 7B model on Kubernetes takes ~45 s (seed); 10 s keeps runs short and still
    longer than the recovery window, so a target that does not route around it shows."""
    first_load_s: float = 2.0
    """Embedded model-load time at the first start only, so the stack is up in seconds."""
    restart_delay_s: float = 0.5
    """Embedded node agents' wait before restarting a dead worker (kubelet back-off)."""
    token_db_latency_ms: float = 5.0
    """Embedded token table round trip per lookup (a networked DB)."""
    token_db_pool_size: int = 4
    """Embedded SQLite connections per gateway: what a cache stampede queues on."""
    tenants: int = 8
    """Embedded tenants seeded in the token table."""
    k8s: dict[str, Any] = field(default_factory=dict)
    """Kubernetes backend settings (target k8s): KubernetesSettings fields by name, from the
    `k8s_<field>` configuration keys and LLMCHAOS_K8S_<FIELD> variables (see the module doc)."""

    # -- the load ------------------------------------------------------------------------
    qps: float = 50.0
    """Total request rate the experiment asks for (the catalogue says 5000, for a cluster)."""
    embedded_max_qps: float = 50.0
    """Highest rate used on the embedded stack, whatever `qps` says. The software path
    carries ~1500 QPS of tiny requests here (bench/stack_capacity.py), but the two simulated
    GPUs are the limit for LLM-shaped ones: one must carry all of it once the other is
    killed (a cluster is sized to survive one failure), and at 50 QPS of the default
    traffic its P99 stays near 2 s, under the 3 s SLO."""
    load_workers: int = 1
    """Locust processes sending the load (one sustains ~2,500 QPS here)."""
    load_profile: str = "poisson"
    """Arrival process: constant, poisson, bursty, stepped, or a profile file."""
    stream_share: float = 0.3
    """Share of streaming requests (TTFT is measured on those)."""
    output_median_tokens: int = 8
    """Median max_tokens of the requests (log-normal, P99 ~5x the median): short answers,
    so the embedded stack's simulated GPUs hold the rate; 64 is typical chat on a cluster."""
    prompt_max_tokens: int = 4096
    """Longest user prompt in tokens (Zipf-like lengths from 10)."""
    bad_token_share: float = 0.0
    """Share of requests with a revoked or unknown token (auth chaos)."""
    bad_tokens: str = "mixed"
    """Which bad tokens: mixed, revoked (stale tokens after a mass refresh), unknown."""
    request_timeout_s: float = 8.0
    """Client timeout of one request (field default 8 s)."""
    warmup_s: float = 8.0
    """Load before the steady-state hypothesis is first checked: caches warm, windows full."""
    max_duration_s: float = 900.0
    """Bound of the load schedule: the load stops by itself after this, whatever happens."""

    # -- the SLO and the verdict ---------------------------------------------------------
    p99_slo_ms: float = 3000.0
    """P99 end-to-end latency (from scheduled send time) a window may have; also the
    end-to-end limit of one request in the goodput (`probes.slo.goodput_qps`)."""
    ttft_slo_ms: float = 2000.0
    """Goodput: time to first token one request may take (MLPerf's llama3.1-8b server SLO)."""
    tpot_slo_ms: float = 100.0
    """Goodput: time per output token one streamed request may take (MLPerf, llama3.1-8b)."""
    error_rate_slo: float = 0.01
    """Failed share a window may have (classes in `error_classes`, dropped sends included)."""
    error_classes: tuple[str, ...] = SLO_ERROR_CLASSES
    """Outcomes that count as failures for the SLO. Other 4xx (bad token, bad request) are
    the client's fault and stay out by default; 429 counts: a shed request is not served."""
    queue_depth_slo: float = 100.0
    """Requests waiting in the engines (sum of vllm:num_requests_waiting) allowed."""
    sla_s: float = 45.0
    """Recovery SLA: seconds from the fault until the SLO holds again for `stable_for_s`
    (seed: a killed GPU process was rescheduled in ~45 s)."""
    window_s: float = 5.0
    """Rolling window over which P99 and error rate are judged."""
    stable_for_s: float = 10.0
    """How long every window must meet the SLO before the service counts as recovered."""
    recovery_timeout_s: float = 0.0
    """How long after the fault the recovery probe waits at most. 0: until recovery within
    the SLA can no longer be shown (sla_s + window_s + stable_for_s + the request timeout,
    for the last requests to settle, + 5 s of reporting lag). The report still measures a
    later recovery from the whole timeline."""
    guard_error_rate: float = 0.5
    """Safety guard: when the error rate stays above this for `guard_for_s`, the run undoes
    every fault and aborts."""
    guard_for_s: float = 120.0
    """Safety guard period; longer than a recovery probe waits, so a known-bad target still
    deviates (its verdict) before the guard aborts it."""

    # -- where output goes ---------------------------------------------------------------
    runs_root: str = "reports/runs"
    """Folder of the run folders (`<time>-<experiment>/`)."""
    stacks_root: str = "reports/stacks"
    """Folder of the embedded stacks' state folders."""

    def __post_init__(self) -> None:
        if self.target not in typing.get_args(Target):
            raise InvalidInput(
                f"target: expected one of {', '.join(typing.get_args(Target))}, got {self.target!r}"
            )
        get_variant(self.variant)
        for name, allowed in SETTING_RANGES.items():
            allowed.check(name, getattr(self, name))
        if self.warmup_s >= self.max_duration_s:
            raise InvalidInput(
                f"warmup_s: expected less than max_duration_s ({self.max_duration_s:g} s, the "
                f"load's whole schedule), got {self.warmup_s:g}"
            )
        processes = self.load_processes
        if processes > MAX_LOAD_PROCESSES:
            raise InvalidInput(
                f"qps: {_plain(self.effective_qps)} needs {processes} load processes on this "
                f"machine (one per {_plain(QPS_PER_LOAD_PROCESS)} QPS, at most "
                f"{MAX_LOAD_PROCESSES}); ask for at most "
                f"{_plain(MAX_LOAD_PROCESSES * QPS_PER_LOAD_PROCESS)}, or load from the cluster"
            )
        unknown = sorted(set(self.error_classes) - set(ERROR_CLASSES))
        if unknown:
            raise InvalidInput(
                f"error_classes: unknown class(es) {', '.join(unknown)}; "
                f"expected some of {', '.join(ERROR_CLASSES)}"
            )
        self.stack_config()  # the embedded stack's own checks (worker counts, ...)
        if self.target == "k8s":
            self.kubernetes_settings()  # its own checks, before anything starts

    # -- derived -------------------------------------------------------------------------
    @property
    def effective_qps(self) -> float:
        """The rate the load runs at: `qps`, capped at `embedded_max_qps` on this machine."""
        if self.target == "embedded":
            return min(self.qps, self.embedded_max_qps)
        return self.qps

    @property
    def load_processes(self) -> int:
        """Locust processes the load needs at `effective_qps` (at least `load_workers`)."""
        return max(self.load_workers, math.ceil(self.effective_qps / QPS_PER_LOAD_PROCESS))

    @property
    def recovery_deadline_s(self) -> float:
        """How long after the last fault the recovery probe gives up."""
        if self.recovery_timeout_s > 0:
            return self.recovery_timeout_s
        return self.sla_s + self.window_s + self.stable_for_s + self.request_timeout_s + 5.0

    def stack_config(self) -> StackConfig:
        """The embedded stack these settings ask for."""
        return StackConfig(
            variant=self.variant,
            netns=self.netns,
            gpu_workers=self.gpu_workers,
            cpu_workers=self.cpu_workers,
            port=0,
            gpu_load_s=self.gpu_load_s,
            first_load_s=self.first_load_s,
            restart_delay_s=self.restart_delay_s,
            token_db_latency_ms=self.token_db_latency_ms,
            token_db_pool_size=self.token_db_pool_size,
            tenants=self.tenants,
            state_root=Path(self.stacks_root),
        )

    def kubernetes_settings(self) -> Any:
        """The Kubernetes backend's settings; raises InvalidInput naming the field. (Imported
        here: the kubernetes client takes a third of a second to import.)"""
        from llmchaos.backends.kubernetes import KubernetesSettings

        if not self.k8s.get("allowed_namespaces"):
            raise InvalidInput(
                "k8s_allowed_namespaces (LLMCHAOS_K8S_ALLOWED_NAMESPACES): required with target "
                "k8s, the namespaces the run may touch, e.g. llm-serving"
            )
        return KubernetesSettings.from_mapping(self.k8s)

    @classmethod
    def from_configuration(
        cls,
        configuration: Mapping[str, Any] | None,
        environ: Mapping[str, str] | None = None,
        *,
        other_keys: Collection[str] = (),
    ) -> RunSettings:
        """Settings from an experiment's resolved configuration and the environment.

        Every configuration key must be a setting, a `k8s_<field>`, or one of `other_keys`
        (what the experiment uses for itself: `${key}` in an activity, or keys another Chaos
        Toolkit extension reads, listed in the llmchaos extension's `foreign_configuration`).
        Raises InvalidInput naming the key, the value and what was expected.
        """
        configuration = dict(configuration or {})
        environ = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        k8s = {
            key[len(ENV_PREFIX + K8S_PREFIX) :].lower(): value
            for key, value in environ.items()
            if key.startswith(ENV_PREFIX + K8S_PREFIX.upper())
        }
        k8s.update(
            {k[len(K8S_PREFIX) :]: v for k, v in configuration.items() if k.startswith(K8S_PREFIX)}
        )
        settable = set(fields) - {"k8s"}  # Kubernetes settings come as k8s_<field> keys
        for key in configuration:
            if key in settable or key.startswith(K8S_PREFIX) or key in other_keys:
                continue
            close = difflib.get_close_matches(key, settable, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise InvalidInput(
                f"configuration.{key}: not a setting; {hint}(a value the experiment uses "
                f"itself must appear as ${{{key}}}, or be listed in the llmchaos extension's "
                '"foreign_configuration")'
            )
        values: dict[str, Any] = {"k8s": k8s}
        origins: dict[str, str] = {}
        for name in settable:
            env_key = ENV_PREFIX + name.upper()
            if name in configuration:
                origins[name] = f"configuration.{name}"
                values[name] = _convert(hints[name], configuration[name], origins[name])
            elif env_key in environ:
                origins[name] = env_key
                values[name] = _convert(hints[name], environ[env_key], env_key)
        try:
            return cls(**values)
        except InvalidInput as exc:  # say where the bad value came from
            name, sep, rest = str(exc).partition(":")
            if sep and name in origins:
                raise InvalidInput(f"{origins[name]}:{rest}") from None
            raise

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> RunSettings:
        """Settings as `to_dict` wrote them (run.json); raises InvalidInput like
        `from_configuration`."""
        hints = typing.get_type_hints(cls)
        values = {
            name: value if name == "k8s" else _convert(hints[name], value, f"settings.{name}")
            for name, value in data.items()
            if name in hints
        }
        return cls(**values)


def _convert(hint: Any, value: Any, where: str) -> Any:
    """`value` (from JSON or a string from the environment) as type `hint`."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise InvalidInput(f"{where}: expected one of {', '.join(allowed)}, got {value!r}")
        return value
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise InvalidInput(f"{where}: expected a list or a comma-separated string")
        return tuple(str(item).strip() for item in items if str(item).strip())
    if hint is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise InvalidInput(f"{where}: expected true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            raise InvalidInput(f"{where}: expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise InvalidInput(f"{where}: expected a number, got {value!r}") from None
        if hint is int:
            if not number.is_integer():
                raise InvalidInput(f"{where}: expected a whole number, got {value!r}")
            return int(number)
        return number
    if hint is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise InvalidInput(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def as_number(name: str, value: object) -> float:
    """`value` as a finite float. Chaos Toolkit hands `${...}` from an env entry or `--var`
    to probes and actions as a string ("45"), so strings of numbers are numbers here.
    Raises InvalidInput naming the argument."""
    if not isinstance(value, bool):
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            pass
        else:
            if math.isfinite(number):
                return number
    raise InvalidInput(f"{name}: expected a number, got {value!r}")
