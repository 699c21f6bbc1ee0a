"""Measurements of a running chaos run: what the probes return.

Client-side figures come from the open-loop load's live windows (latency from the scheduled
send time, so an outage shows), target-side ones from the backend. Each function takes the
run, so it can be used outside Chaos Toolkit too.

`window_s=0` means the run's `window_s` setting; `since_fault=True` means the window from the
last fault until now, and before the first fault an empty window (0 requests, 0 errors), so
the same probe can sit in the steady-state hypothesis, which also runs before the method.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from llmchaos.analysis import SecondRecord, Slo, recovery, rolling_windows
from llmchaos.errors import InvalidInput, LLMChaosError
from llmchaos.run import ChaosRun
from llmchaos.settings import ERROR_CLASSES, as_number

__all__ = [
    "NotRecovered",
    "achieved_qps",
    "error_rate",
    "frame_drops",
    "goodput_qps",
    "healthy_workers",
    "itl_p99_ms",
    "kv_cache_usage",
    "p99_latency_ms",
    "queue_depth",
    "recovery_time_s",
    "served_in_mode_since_fault",
    "serving_mode_share",
    "slo",
    "tpot_p99_ms",
    "ttft_p99_ms",
    "window_error_rate",
    "worker_share_after_fault",
    "worst_p99_ms_since_fault",
]

log = logging.getLogger("chaostoolkit")

_POLL_S = 1.0


class NotRecovered(LLMChaosError):
    """The SLO did not hold again for the stable period before the probe's deadline."""


def slo(run: ChaosRun) -> Slo:
    s = run.settings
    return Slo(p99_ms=s.p99_slo_ms, error_rate=s.error_rate_slo, error_classes=s.error_classes)


_EMPTY_WINDOW: dict[str, Any] = {
    "ok": 0,
    "failed": {},
    "dropped": 0,
    "achieved_qps": 0.0,
    "frame_drops": 0,
    "latency_with_unanswered_ms": {"p99": None},
    "ttft_ms": {"p99": None},
    "itl_ms": {"p99": None},
    "tpot_ms": {"p99": None},
    "goodput_qps": 0.0,
    "serving_mode_share": {},
}


def _window(run: ChaosRun, window_s: float, since_fault: bool) -> dict[str, Any]:
    window_s = as_number("window_s", window_s)
    if window_s < 0:
        raise InvalidInput(f"window_s: expected seconds >= 0, got {window_s}")
    if since_fault:
        fault_ts = run.last_fault_ts()
        if fault_ts is None:
            return _EMPTY_WINDOW
        return run.traffic.window(since_ts=fault_ts)
    return run.traffic.window(last_s=window_s or run.settings.window_s)


def p99_latency_ms(run: ChaosRun, window_s: float = 0.0, since_fault: bool = False) -> float:
    """P99 end-to-end latency (from the scheduled send time), requests still unanswered
    counted at their age so far. 0 when nothing was sent in the window."""
    value = _window(run, window_s, since_fault)["latency_with_unanswered_ms"]["p99"]
    return float(value or 0.0)


def ttft_p99_ms(run: ChaosRun, window_s: float = 0.0, since_fault: bool = False) -> float:
    """P99 time to first token of the streaming requests: from the scheduled send time to the
    first chunk with non-empty content (0 when there were none)."""
    return float(_window(run, window_s, since_fault)["ttft_ms"]["p99"] or 0.0)


def itl_p99_ms(run: ChaosRun, window_s: float = 0.0, since_fault: bool = False) -> float:
    """P99 of the gaps between successive content chunks of the streams (0 when none)."""
    return float(_window(run, window_s, since_fault)["itl_ms"]["p99"] or 0.0)


def tpot_p99_ms(run: ChaosRun, window_s: float = 0.0, since_fault: bool = False) -> float:
    """P99 time per output token of the streams, (e2e - TTFT) / (output tokens - 1)
    (0 when none)."""
    return float(_window(run, window_s, since_fault)["tpot_ms"]["p99"] or 0.0)


def goodput_qps(run: ChaosRun, window_s: float = 0.0, since_fault: bool = False) -> float:
    """Requests per second in the window that met every SLO of the run: TTFT <= ttft_slo_ms,
    TPOT <= tpot_slo_ms and end to end <= p99_slo_ms (DistServe's goodput, vLLM's
    `--goodput`); by scheduled time."""
    return float(_window(run, window_s, since_fault)["goodput_qps"] or 0.0)


def error_rate(
    run: ChaosRun,
    window_s: float = 0.0,
    since_fault: bool = False,
    classes: list[str] | None = None,
) -> float:
    """Failed share of the requests answered or dropped in the window, counting `classes`
    (default: the run's SLO error classes) and dropped sends."""
    chosen = tuple(classes) if classes else run.settings.error_classes
    unknown = sorted(set(chosen) - set(ERROR_CLASSES))
    if unknown:
        raise InvalidInput(f"classes: unknown {unknown}; expected some of {list(ERROR_CLASSES)}")
    return window_error_rate(_window(run, window_s, since_fault), chosen)


def window_error_rate(window: dict[str, Any], classes: tuple[str, ...]) -> float:
    """Failed share of a load window: failures of `classes` plus dropped sends, over the
    requests answered plus dropped (0 when there were none)."""
    answered = window["ok"] + sum(window["failed"].values())
    failures = sum(n for cls, n in window["failed"].items() if cls in classes)
    total = answered + window["dropped"]
    return round((failures + window["dropped"]) / total, 5) if total else 0.0


def frame_drops(run: ChaosRun, window_s: float = 0.0, since_fault: bool = True) -> int:
    """Gaps of 3 s or more without a successful answer (since the last fault by default)."""
    return int(_window(run, window_s, since_fault)["frame_drops"])


def achieved_qps(run: ChaosRun, window_s: float = 0.0) -> float:
    """Answered requests per second over the window."""
    return float(_window(run, window_s, False)["achieved_qps"])


def serving_mode_share(
    run: ChaosRun, mode: str = "cpu", window_s: float = 0.0, since_fault: bool = True
) -> float:
    """Share of answers served in `mode` (gpu or cpu), since the last fault by default."""
    if mode not in ("gpu", "cpu"):
        raise InvalidInput(f"mode: expected gpu or cpu, got {mode!r}")
    return float(_window(run, window_s, since_fault)["serving_mode_share"].get(mode, 0.0))


def served_in_mode_since_fault(run: ChaosRun, mode: str = "cpu", min_share: float = 0.01) -> bool:
    """Since the last fault, at least `min_share` of the answers came from `mode` workers
    (did the service degrade to CPU rather than fail?). True before any fault."""
    min_share = as_number("min_share", min_share)
    if not 0 <= min_share <= 1:
        raise InvalidInput(f"min_share: expected a share within 0..1, got {min_share}")
    if run.last_fault_ts() is None:
        return True
    share = serving_mode_share(run, mode, since_fault=True)
    log.info("llmchaos: %.1f%% of the answers since the fault came from %s", share * 100, mode)
    return share >= min_share


def queue_depth(run: ChaosRun) -> float:
    """Requests waiting in the engines now (sum of vllm:num_requests_waiting)."""
    return run.target.queue_depth()


def kv_cache_usage(run: ChaosRun) -> float:
    """The fullest KV cache of the target's engines (0..1). Raises InvalidInput when the
    target's engines export none (a probe must not read "no data" as an empty cache)."""
    usage = run.target.kv_cache_usage()
    if usage is None:
        raise InvalidInput(
            f"kv_cache_usage: the {run.settings.target} target's engines export none"
        )
    return usage


def healthy_workers(run: ChaosRun, mode: str = "") -> int:
    """Workers answering ready now, of `mode` (gpu, cpu; "" = any)."""
    if mode not in ("", "gpu", "cpu"):
        raise InvalidInput(f"mode: expected gpu, cpu or empty, got {mode!r}")
    return run.target.healthy_workers(mode)


def _records_since(run: ChaosRun, since_ts: float) -> list[SecondRecord]:
    return [SecondRecord.from_line(item) for item in run.traffic.seconds(since_ts=since_ts)]


def recovery_time_s(run: ChaosRun, timeout_s: float = 0.0) -> float:
    """Seconds from the last fault until the SLO held again for the stable period.

    Waits for it, up to `timeout_s` after the fault (0: the run's recovery deadline). With no
    fault yet, checks nothing and returns 0. Raises NotRecovered at the deadline.
    """
    timeout_s = as_number("timeout_s", timeout_s)
    fault_ts = run.last_fault_ts()
    if fault_ts is None:
        return 0.0
    s = run.settings
    deadline_ts = fault_ts + (timeout_s or s.recovery_deadline_s)
    # windows that start before the fault are part of the picture (the first window ends
    # with the fault's second), so read from one window earlier
    since_ts = fault_ts - s.window_s - 1
    last_report = 0.0
    while True:
        now = time.time()
        result = recovery(
            _records_since(run, since_ts),
            fault_ts,
            slo(run),
            window_s=s.window_s,
            stable_for_s=s.stable_for_s,
            now_ts=now,
        )
        if result.recovered and result.recovery_time_s is not None:
            log.info("llmchaos: recovered %.1f s after the fault", result.recovery_time_s)
            return result.recovery_time_s
        if now >= deadline_ts:
            detected = (
                f"first SLO miss {result.detected_at_ts - fault_ts:.0f} s after it"
                if result.detected_at_ts
                else "no SLO miss seen"
            )
            raise NotRecovered(
                f"not recovered {now - fault_ts:.0f} s after the fault ({detected}): the SLO "
                f"(p99 <= {s.p99_slo_ms:g} ms, errors <= {s.error_rate_slo:.2%}) did not hold "
                f"for {s.stable_for_s:g} s; SLA {s.sla_s:g} s"
            )
        if now - last_report >= 10:
            log.info("llmchaos: waiting for recovery (%.0f s since the fault)", now - fault_ts)
            last_report = now
        time.sleep(_POLL_S)


def worst_p99_ms_since_fault(run: ChaosRun) -> float:
    """Highest P99 of a rolling window since the last fault (0 with no fault or no data)."""
    fault_ts = run.last_fault_ts()
    if fault_ts is None:
        return 0.0
    s = run.settings
    windows = rolling_windows(_records_since(run, fault_ts), slo(run), s.window_s)
    return max((w.p99_ms or 0.0 for w in windows), default=0.0)


def worker_share_after_fault(run: ChaosRun, worker: str, window_s: float = 0.0) -> float:
    """Share of the requests the GPU workers took over the next `window_s` seconds (the run's
    window by default) that `worker` took: did routing shift load away from it? From the
    engines' own metrics: finished (vllm:request_success) plus in the engine (running and
    waiting), whose difference over the window counts arrivals even when an engine falls
    behind. 0 before any fault (nothing to judge yet), so it can sit in the steady-state
    hypothesis."""
    window_s = as_number("window_s", window_s) or run.settings.window_s
    if window_s < 0:
        raise InvalidInput(f"window_s: expected seconds >= 0, got {window_s}")
    info = run.target.info()
    (name,) = info.gpu_workers(worker, "")
    if run.last_fault_ts() is None:
        return 0.0
    gpus = {w.name for w in info.workers if w.mode == "gpu"}
    before = run.target.requests_taken()
    if before is None:
        raise InvalidInput(
            f"worker_share_after_fault: the {run.settings.target} target "
            "cannot read its engines' request counters"
        )
    time.sleep(window_s)
    after = run.target.requests_taken() or {}
    done = {w: after.get(w, 0.0) - before.get(w, after.get(w, 0.0)) for w in gpus}
    total = sum(max(0.0, n) for n in done.values())
    share = max(0.0, done.get(name, 0.0)) / total if total else 0.0
    log.info(
        "llmchaos: %s finished %.0f of %.0f GPU requests in %g s",
        name,
        done.get(name, 0.0),
        total,
        window_s,
    )
    return round(share, 4)
