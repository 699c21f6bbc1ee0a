"""The settings of one chaos run: `RunSettings` (the run, its load, its SLO) and, inside it,
the target's own settings, all built from the experiment and the environment.

    settings = RunSettings.from_configuration(configuration, other_keys={"my_key"})
    settings.target_settings        # EmbeddedSettings, KubernetesSettings, HostsSettings

Values come from the experiment's `configuration` (after Chaos Toolkit resolved its `env`
entries and `--var` overrides), else from `LLMCHAOS_<KEY>`, else the default (see
llmchaos.configuration). The target's settings are its kind's keys: the embedded stack's
without a prefix (`variant`, `gpu_load_s`), Kubernetes' as `k8s_<field>`, the hosts target's
as `hosts_<field>`. A configuration key no settings read is an error, with the nearest one as
a hint: a typo must not silently fall back to the default.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmchaos.analysis import SLO_ERROR_CLASSES
from llmchaos.configuration import (
    Range,
    as_number,
    build_settings,
    check_known_keys,
    check_ranges,
    plain,
    settings_from_record,
    settings_keys,
)
from llmchaos.errors import InvalidInput
from llmchaos.load.config import QPS_PER_PROCESS as QPS_PER_LOAD_PROCESS
from llmchaos.load.config import inflight_cap_for
from llmchaos.load.timeline import FAILURE_CLASSES
from llmchaos.load.traffic import TrafficSpec
from llmchaos.targets import KINDS, TargetSettings, target_kind
from llmchaos.targets.cpu_throttle import MIN_CPU_PERCENT

__all__ = [
    "ERROR_CLASSES",
    "MAX_LOAD_PROCESSES",
    "QPS_PER_LOAD_PROCESS",
    "SETTING_RANGES",
    "RunSettings",
    "argument_ranges",
    "as_number",
]

ERROR_CLASSES = FAILURE_CLASSES
"""Failure classes the load counts: what `error_classes` may name."""
MAX_LOAD_PROCESSES = 64
"""Most load processes one machine runs (LoadConfig.workers allows 64)."""

_DAY_S = 86400.0
SETTING_RANGES: dict[str, Range] = {
    "qps": Range(0, 1_000_000, low_open=True),
    "peak_factor": Range(1, 100),
    "load_workers": Range(1, MAX_LOAD_PROCESSES),
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
is the most any run may ask for (the traffic's and the target's numbers have their own)."""


def argument_ranges(settings: RunSettings) -> dict[str, Range]:
    """What probe and action arguments of these names may be, in a run with `settings`: a
    rate at most what a run may ask, durations and windows within the load's schedule."""
    longest_s = settings.max_duration_s
    return {
        "qps": SETTING_RANGES["qps"],
        "duration_s": Range(0, longest_s, low_open=True),
        "hold_s": Range(0, longest_s),
        "factor": Range(0, 100, low_open=True),
        "limit": Range(0, math.inf),
        "min_share": Range(0, 1),
        "window_s": Range(0, longest_s),
        "timeout_s": Range(0, longest_s),
        "ttl_s": Range(0, 30 * _DAY_S),
        # gray failures and resource faults
        "slowdown": Range(1, 1000),
        "xid": Range(1, 1000),
        "cpu_percent": Range(MIN_CPU_PERCENT, 100 * (os.cpu_count() or 1)),
        "limit_mib": Range(1, 1 << 20),
        "grow_mib_s": Range(0, 1 << 14, low_open=True),
        "delay_ms": Range(0, 60_000),
        "jitter_ms": Range(0, 60_000),
        "loss_percent": Range(0, 100),
        "rate_kbit": Range(0, 100_000_000),
        "prompt_tokens": Range(1, 1_000_000),
        "max_tokens": Range(1, 1_000_000),
    }


@dataclass(frozen=True)
class RunSettings:
    """Everything one chaos run can be told; each field has a default and says why."""

    # -- the target ---------------------------------------------------------------------
    target: str = "embedded"
    """Which kind of target: embedded (the reference stack on this machine, started and
    stopped by the run), k8s (a cluster, through the official client), hosts (the user's own
    serving processes on this machine, described in a file)."""
    target_settings: TargetSettings | None = None
    """The target's own settings (its kind's dataclass); None: its defaults."""

    # -- the load ------------------------------------------------------------------------
    qps: float = 50.0
    """Total request rate the experiment asks for (the catalogue says 5000, for a cluster)."""
    peak_factor: float = 1.0
    """How far above the rate the experiment's method takes the load at most (a burst that
    doubles it: 2). A target with a cap (this machine's calibrated rate) takes `qps` up to
    the cap divided by this, so the peak fits, and a fleet is laid out for the peak."""
    load_workers: int = 1
    """Locust processes sending the load (one sustains ~2,500 QPS here)."""
    load_profile: str = "poisson"
    """Arrival process: constant, poisson, bursty, stepped, or a profile file."""
    traffic: TrafficSpec = field(default_factory=TrafficSpec)
    """The request mix (llmchaos.load.traffic.TrafficSpec, the load's own definition): its
    fields are configuration keys of their own (`stream_share`, `output_median_tokens`,
    `bad_token_share`, ...)."""
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
    """Requests waiting in the engines allowed: the limit of the queue-depth probe (the sum
    of vllm:num_requests_waiting, or per GPU worker when it says `per_gpu`, as the
    catalogue's do)."""
    sla_s: float = 45.0
    """Recovery SLA: seconds from the fault until the SLO holds again for `stable_for_s`
    (seed: a killed GPU process was rescheduled in ~45 s)."""
    window_s: float = 5.0
    """Rolling window over which P99 and error rate are judged."""
    stable_for_s: float = 10.0
    """How long every window must meet the SLO before the service counts as recovered."""
    recovery_timeout_s: float = 0.0
    """How long after the fault the recovery probe waits at most. 0: until recovery within
    the SLA can no longer be shown: as soon as the windows rule it out, at most sla_s +
    window_s + stable_for_s + the request timeout, for the last requests to settle, + 5 s of
    reporting lag. The report still measures a later recovery from the whole timeline."""
    guard_error_rate: float = 0.5
    """Safety guard: when the error rate stays above this for `guard_for_s`, the run undoes
    every fault and aborts."""
    guard_for_s: float = 120.0
    """Safety guard period; longer than a recovery probe waits, so a known-bad target still
    deviates (its verdict) before the guard aborts it."""

    # -- where output goes ---------------------------------------------------------------
    runs_root: str = "reports/runs"
    """Folder of the run folders (`<time>-<experiment>/`)."""

    def __post_init__(self) -> None:
        kind = target_kind(self.target)
        if self.target_settings is None:
            object.__setattr__(self, "target_settings", kind.settings({}, {}))
        elif not isinstance(self.target_settings, kind.settings_type):
            raise InvalidInput(
                f"target_settings: expected {kind.settings_type.__name__} for target "
                f"{self.target}, got {type(self.target_settings).__name__}"
            )
        check_ranges(self, SETTING_RANGES)
        if self.warmup_s >= self.max_duration_s:
            raise InvalidInput(
                f"warmup_s: expected less than max_duration_s ({self.max_duration_s:g} s, the "
                f"load's whole schedule), got {self.warmup_s:g}"
            )
        processes = self.load_processes
        if processes > MAX_LOAD_PROCESSES:
            raise InvalidInput(
                f"qps: {plain(self.effective_qps)} needs {processes} load processes on this "
                f"machine (one per {plain(QPS_PER_LOAD_PROCESS)} QPS, at most "
                f"{MAX_LOAD_PROCESSES}); ask for at most "
                f"{plain(MAX_LOAD_PROCESSES * QPS_PER_LOAD_PROCESS)}, or load from the cluster"
            )
        unknown = sorted(set(self.error_classes) - set(ERROR_CLASSES))
        if unknown:
            raise InvalidInput(
                f"error_classes: unknown class(es) {', '.join(unknown)}; "
                f"expected some of {', '.join(ERROR_CLASSES)}"
            )

    # -- derived -------------------------------------------------------------------------
    @property
    def variant(self) -> str:
        """The target's variant (default, or a known-bad one)."""
        assert self.target_settings is not None
        return self.target_settings.variant

    @property
    def effective_qps(self) -> float:
        """The rate the load runs at: `qps`, capped at what the target takes (the embedded
        stack's calibrated rate on this machine) divided by `peak_factor`."""
        cap = self.target_max_qps
        return self.qps if cap is None else min(self.qps, cap / self.peak_factor)

    @property
    def load_processes(self) -> int:
        """Locust processes the load needs at `effective_qps` (at least `load_workers`)."""
        return max(self.load_workers, math.ceil(self.effective_qps / QPS_PER_LOAD_PROCESS))

    @property
    def target_max_qps(self) -> float | None:
        """The most the target takes (the embedded stack: this machine's calibrated rate, or
        embedded_max_qps), where `set_qps` stops; None: no cap."""
        assert self.target_settings is not None
        return target_kind(self.target).max_qps(self.target_settings)

    @property
    def load_inflight_cap(self) -> int:
        """Most requests in flight per load process (load.config.inflight_cap_for) at the
        highest rate the run reaches: the rate times `peak_factor`, or the target's cap when
        it has one (`set_qps` stops there)."""
        cap = self.target_max_qps
        peak_qps = cap if cap is not None else self.effective_qps * self.peak_factor
        return inflight_cap_for(peak_qps, self.load_processes, self.request_timeout_s)

    @property
    def recovery_deadline_s(self) -> float:
        """How long after the last fault the recovery probe gives up."""
        if self.recovery_timeout_s > 0:
            return self.recovery_timeout_s
        return self.sla_s + self.window_s + self.stable_for_s + self.request_timeout_s + 5.0

    @classmethod
    def from_configuration(
        cls,
        configuration: Mapping[str, Any] | None,
        environ: Mapping[str, str] | None = None,
        *,
        other_keys: Collection[str] = (),
    ) -> RunSettings:
        """Settings from an experiment's resolved configuration and the environment.

        Every configuration key must be read by some settings (the run's, or any target
        kind's: an experiment may carry the keys of several targets), or be one of
        `other_keys` (what the experiment uses for itself: `${key}` in an activity, or keys
        another Chaos Toolkit extension reads, listed in the llmchaos extension's
        `foreign_configuration`). Raises InvalidInput naming the key, the value and what was
        expected.
        """
        configuration = dict(configuration or {})
        environ = os.environ if environ is None else environ
        target = build_settings(_TargetName, configuration, environ).target
        kind = target_kind(target)
        known = settings_keys(cls) - {"target_settings"}
        for name in KINDS:
            known |= target_kind(name).keys()
        check_known_keys(configuration, known, other_keys)
        target_settings = kind.settings(configuration, environ)
        run = build_settings(
            cls,
            configuration,
            environ,
            extra={"target": target, "target_settings": target_settings},
        )
        sized = kind.sized_for(target_settings, run.effective_qps * run.peak_factor, run.traffic)
        return run if sized is target_settings else dataclasses.replace(run, target_settings=sized)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> RunSettings:
        """Settings as `to_dict` wrote them (run.json); raises InvalidInput like
        `from_configuration`."""
        target = str(data.get("target", "embedded"))
        target_settings = target_kind(target).from_record(dict(data.get("target_settings") or {}))
        return settings_from_record(cls, data, extra={"target_settings": target_settings})


@dataclass(frozen=True)
class _TargetName:
    target: str = "embedded"
