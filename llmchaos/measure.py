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
from llmchaos.errors import InvalidInput, LLMChaosError, StackError
from llmchaos.run import ChaosRun
from llmchaos.settings import ERROR_CLASSES, as_number

__all__ = [
    "DEGRADED_COUNTER",
    "UNSHED_CLASSES",
    "NotMeasured",
    "NotRecovered",
    "achieved_qps",
    "degradation_trigger_delay_s",
    "degraded_unshed_failure_rate",
    "error_rate",
    "frame_drops",
    "goodput_qps",
    "healthy_workers",
    "itl_p99_ms",
    "kv_cache_usage",
    "p99_latency_ms",
    "pulse_error_rate",
    "pulse_p99_ms",
    "queue_depth",
    "recovery_time_s",
    "registry_has_leader",
    "scale_in_s",
    "scale_out_s",
    "served_in_mode_since_fault",
    "serving_mode_share",
    "settle_at_min_replicas",
    "slo",
    "tpot_p99_ms",
    "ttft_p99_ms",
    "watch_degradation",
    "watch_scale_in",
    "watch_scale_out",
    "window_error_rate",
    "worker_share_after_fault",
    "worst_p99_ms_since_fault",
]

log = logging.getLogger("chaostoolkit")

_POLL_S = 0.25
"""How often the waiting probes read the load's seconds: a verdict comes a poll late at most."""


class NotRecovered(LLMChaosError):
    """The SLO did not hold again for the stable period before the probe's deadline."""


class NotMeasured(LLMChaosError):
    """What a probe of the hypothesis judges did not happen during the method (a trigger
    that never fired, a queue that never drained), or could not be read (a worker's counters
    that never answered)."""


DEGRADED_COUNTER = "service_degraded_total"
"""The gateways' count of entries into degraded mode (llmchaos.stack.gateway.degradation)."""
DEGRADED_ANSWERS = "llmchaos_gateway_degraded_requests_total"
DEGRADED_NOW = "llmchaos_gateway_degraded"
"""1 per gateway degraded now."""
_WATCH_POLL_S = 0.1


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


def _window(
    run: ChaosRun, window_s: float, since_fault: bool, whole_run: bool = False
) -> dict[str, Any]:
    window_s = as_number("window_s", window_s)
    if window_s < 0:
        raise InvalidInput(f"window_s: expected seconds >= 0, got {window_s}")
    if whole_run:
        return run.traffic.window(since_ts=run.load_start_ts or run.traffic.wait_started())
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
    whole_run: bool = False,
) -> float:
    """Failed share of the requests answered or dropped in the window (or the whole run so
    far), counting `classes` (default: the run's SLO error classes) and dropped sends."""
    chosen = tuple(classes) if classes else run.settings.error_classes
    unknown = sorted(set(chosen) - set(ERROR_CLASSES))
    if unknown:
        raise InvalidInput(f"classes: unknown {unknown}; expected some of {list(ERROR_CLASSES)}")
    return window_error_rate(_window(run, window_s, since_fault, whole_run), chosen)


def window_error_rate(window: dict[str, Any], classes: tuple[str, ...]) -> float:
    """Failed share of a load window: failures of `classes` plus dropped sends, over the
    requests answered plus dropped (0 when there were none)."""
    answered = window["ok"] + sum(window["failed"].values())
    failures = sum(n for cls, n in window["failed"].items() if cls in classes)
    total = answered + window["dropped"]
    return round((failures + window["dropped"]) / total, 5) if total else 0.0


def frame_drops(
    run: ChaosRun, window_s: float = 0.0, since_fault: bool = True, whole_run: bool = False
) -> int:
    """Gaps of 3 s or more without a successful answer (since the last fault by default, or
    over the whole run so far); the whole run's are noted for the report with their spacing."""
    window = _window(run, window_s, since_fault, whole_run)
    if whole_run:
        events = window.get("frame_drop_events") or []
        starts = [start for start, _ in events]
        spacing = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else None
        prefix = "frame drops over the whole run:"
        run.notes[:] = [n for n in run.notes if not n.startswith(prefix)]  # the latest count
        run.notes.append(
            f"{prefix} {len(events)}"
            + (f" at {', '.join(f'+{s:g} s ({n:g} s)' for s, n in events)}" if events else "")
            + (f"; mean spacing {spacing:.1f} s" if spacing is not None else "")
        )
    return int(window["frame_drops"])


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


def queue_depth(run: ChaosRun, per_gpu: bool = False) -> float:
    """Requests waiting in the engines now (sum of vllm:num_requests_waiting); `per_gpu`:
    divided by the GPU workers the target has, dead ones included (the average per replica
    that autoscalers scale on: the same bound whatever the fleet's size)."""
    depth = run.target.queue_depth()
    if not per_gpu:
        return depth
    return depth / max(1, run.target.info().gpu_count)


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


class _LiveRecords:
    """The load's seconds from `since_ts` on, read again at each poll from the first that was
    not final yet: a final second no worker can change, and a probe polling four times a
    second would otherwise have the load's master serialize every second since the fault."""

    def __init__(self, run: ChaosRun, since_ts: float) -> None:
        self._run = run
        self._final: list[SecondRecord] = []
        self._from_ts = since_ts

    def read(self) -> list[SecondRecord]:
        fresh = []
        for line in self._run.traffic.seconds(since_ts=self._from_ts):
            record = SecondRecord.from_line(line)
            if line.get("final") and not fresh:
                self._final.append(record)
                # the next second's "ts", within the load's 1-ms rounding of it
                self._from_ts = float(line["ts"]) + 1.0
            else:
                fresh.append(record)
        return [*self._final, *fresh]


def recovery_time_s(run: ChaosRun, timeout_s: float = 0.0) -> float:
    """Seconds from the last fault until the SLO held again for the stable period.

    Waits for it, up to `timeout_s` after the fault. With no fault yet, checks nothing and
    returns 0. Raises NotRecovered at the deadline; with neither `timeout_s` nor the run's
    `recovery_timeout_s` set, also as soon as the records rule out a recovery within the SLA
    (a known-bad target's verdict then takes seconds after the SLA, not the whole deadline),
    and the deadline is then no sooner than a fault that acts for a while (a surge, until
    its last answer) could be judged over (llmchaos.analysis: the stable run outlasts it).
    """
    timeout_s = as_number("timeout_s", timeout_s)
    fault_ts = run.last_fault_ts()
    if fault_ts is None:
        return 0.0
    s = run.settings
    until_sla_missed = not (timeout_s or s.recovery_timeout_s)
    deadline_ts = fault_ts + (timeout_s or s.recovery_deadline_s)
    # windows that start before the fault are part of the picture (the first window ends
    # with the fault's second), so read from one window earlier
    records = _LiveRecords(run, fault_ts - s.window_s - 1)
    last_report = 0.0
    while True:
        now = time.time()
        # read again each time: a surge acts until its last answer is in
        active_until_ts = run.faults_active_until()
        if until_sla_missed and active_until_ts is not None:
            # a stable run must outlast a fault that acts for a while: wait for its last window
            settled_ts = active_until_ts + s.window_s + s.request_timeout_s + 5
            deadline_ts = max(deadline_ts, settled_ts)
        result = recovery(
            records.read(),
            fault_ts,
            slo(run),
            window_s=s.window_s,
            stable_for_s=s.stable_for_s,
            now_ts=now,
            active_until_ts=active_until_ts,
        )
        if result.recovered and result.recovery_time_s is not None:
            log.info("llmchaos: recovered %.1f s after the fault", result.recovery_time_s)
            return result.recovery_time_s
        sla_missed = (
            until_sla_missed
            and result.earliest_recovery_s is not None
            and result.earliest_recovery_s > s.sla_s
        )
        if now >= deadline_ts or sla_missed:
            detected = (
                f"first SLO miss {result.detected_at_ts - fault_ts:.0f} s after it"
                if result.detected_at_ts
                else "no SLO miss seen"
            )
            when = (
                f"the windows missed the SLO until a recovery could start "
                f"{result.earliest_recovery_s:.0f} s after the fault at the soonest"
                if sla_missed
                else f"the SLO (p99 <= {s.p99_slo_ms:g} ms, errors <= {s.error_rate_slo:.2%}) "
                f"did not hold for {s.stable_for_s:g} s"
            )
            raise NotRecovered(
                f"not recovered {now - fault_ts:.0f} s after the fault ({detected}): {when}; "
                f"SLA {s.sla_s:g} s"
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


def watch_degradation(
    run: ChaosRun,
    queue_depth_threshold: float = 500,
    timeout_s: float = 30.0,
    degraded_for_s: float = 10.0,
) -> dict[str, Any]:
    """From now on, read the engines' queue (their vllm:num_requests_waiting) and the
    gateways' service_degraded_total every 0.1 s: when the queue first passes the threshold
    and when the counter first moves (up to `timeout_s`); after the jump, go on for
    `degraded_for_s` (the overload seen in degraded mode). The figures go to the run's
    findings, for `degradation_trigger_delay_s` and `degraded_unshed_failure_rate`, and are
    returned."""
    threshold = as_number("queue_depth_threshold", queue_depth_threshold)
    timeout_s = as_number("timeout_s", timeout_s)
    degraded_for_s = as_number("degraded_for_s", degraded_for_s)
    target = run.target
    started = time.time()
    first = target.gateway_metrics((DEGRADED_COUNTER, DEGRADED_ANSWERS, DEGRADED_NOW))
    entered0, answers0 = first[DEGRADED_COUNTER], first[DEGRADED_ANSWERS]
    crossed = jumped = None
    # A gateway may degrade between the overload's start and this first read (seen on a busy
    # machine: its /metrics took longer than the queue took to pass the threshold); it fired
    # before the watch could see the crossing, so its delay counts as 0.
    if first[DEGRADED_NOW] > 0:
        jumped = 0.0
    unread = 0
    peak = peak_degraded = 0.0
    while True:
        now = time.time() - started
        if jumped is None and now >= timeout_s:
            break
        if jumped is not None and now >= jumped + degraded_for_s:
            break
        queue = target.queue_depth()
        peak = max(peak, queue)
        if crossed is None and queue > threshold:
            crossed = now
        if jumped is None:
            try:
                if target.gateway_metric(DEGRADED_COUNTER) > entered0:
                    jumped = now
            except StackError:
                unread += 1  # not seen is not zero: read again next time
        if jumped is not None:
            peak_degraded = max(peak_degraded, queue)
        time.sleep(_WATCH_POLL_S)
    found = {
        "queue_depth_threshold": threshold,
        "queue_crossed_at_s": None if crossed is None else round(crossed, 2),
        "counter_jumped_at_s": None if jumped is None else round(jumped, 2),
        "delay_s": None if crossed is None or jumped is None else round(jumped - crossed, 2),
        "peak_queue": peak,
        "peak_queue_degraded": peak_degraded,
        "degraded_answers": _increase(target, DEGRADED_ANSWERS, answers0),
        "degraded_from_ts": None if jumped is None else round(started + jumped, 3),
        "degraded_to_ts": round(time.time(), 3),
        "watched_s": round(time.time() - started, 1),
        "unanswered_counter_reads": unread,
    }
    run.findings["degradation"] = found
    shown = ("queue_crossed_at_s", "counter_jumped_at_s", "delay_s", "peak_queue")
    run.notes.append(
        "degradation watch: "
        + ", ".join(f"{k} {found[k]}" for k in shown)
        + f", degraded answers {found['degraded_answers']}"
    )
    log.info("llmchaos: degradation watch: %s", found)
    return found


def _increase(target: Any, name: str, before: float) -> float | None:
    """How much the gateways' `name` grew since `before`; None when none answered."""
    try:
        return float(target.gateway_metric(name) - before)
    except StackError:
        return None


def _degradation(run: ChaosRun) -> dict[str, Any] | None:
    return run.findings.get("degradation")


def degradation_trigger_delay_s(run: ChaosRun) -> float:
    """Seconds from the engines' queue passing the threshold to the gateways' jump of
    service_degraded_total, as `watch_degradation` saw them (0 when it has not run: before
    the method; at least 0: a gateway that saw the crossing before the watch did fired at
    once). Raises NotMeasured when the queue never passed the threshold or the counter never
    moved."""
    found = _degradation(run)
    if found is None:
        return 0.0
    threshold = f"{found['queue_depth_threshold']:g}"
    if found["queue_crossed_at_s"] is None:
        raise NotMeasured(
            f"the engines' queue never passed {threshold} in {found['watched_s']} s (peak "
            f"{found['peak_queue']:g}): the load did not drive it there; raise the rate"
        )
    if found["counter_jumped_at_s"] is None:
        raise NotMeasured(
            f"the engines' queue passed {threshold} at +{found['queue_crossed_at_s']} s (peak "
            f"{found['peak_queue']:g}) and {DEGRADED_COUNTER} did not move within "
            f"{found['watched_s']} s: the degradation trigger did not fire"
        )
    return max(0.0, float(found["delay_s"]))


UNSHED_CLASSES = ("5xx", "timeout", "connection", "bad_body")
"""Failures a degraded service should not give: every class but the 429 it sheds with."""


def degraded_unshed_failure_rate(run: ChaosRun) -> float:
    """Share of the requests scheduled while degraded under the overload (as
    `watch_degradation` saw it) that failed other than by a 429: timeouts, 5xx, broken
    answers. Waits until those requests have all answered or timed out. 0 before the method;
    raises NotMeasured when the gateways never degraded."""
    found = _degradation(run)
    if found is None:
        return 0.0
    if found["degraded_from_ts"] is None:
        raise NotMeasured(
            f"{DEGRADED_COUNTER} never moved during the {found['watched_s']} s watch: there "
            "was no degraded mode to judge"
        )
    since, until = found["degraded_from_ts"], found["degraded_to_ts"]
    window = _settled_window(run, since, until)
    rate = window_error_rate(window, UNSHED_CLASSES)
    log.info(
        "llmchaos: while degraded: %s ok, failed %s, %.1f%% failed other than by a 429",
        window["ok"],
        window["failed"],
        rate * 100,
    )
    return rate


def _settled_window(run: ChaosRun, since_ts: float, until_ts: float) -> dict[str, Any]:
    """The load's window of the requests scheduled in [since_ts, until_ts), once they have all
    answered or timed out (or the request timeout and 5 s have passed)."""
    deadline = until_ts + run.settings.request_timeout_s + 5.0
    window = run.traffic.window(since_ts=since_ts, until_ts=until_ts)
    while window["in_flight"] > 0 and time.time() < deadline:
        time.sleep(_POLL_S)
        window = run.traffic.window(since_ts=since_ts, until_ts=until_ts)
    return window


def settle_at_min_replicas(run: ChaosRun, timeout_s: float = 60.0) -> float:
    """Before a pulse: wait until the GPU pool is at its minimum, every replica ready, so that
    the pulse starts from the pool's floor (an autoscaler may scale out during the warm-up
    when the machine is busy, and scales back in after its window). Returns the seconds
    waited; a pool still above its minimum after `timeout_s` is left to the scale-out watch,
    which then says so."""
    timeout_s = as_number("timeout_s", timeout_s)
    started = time.monotonic()
    replicas = run.target.replicas()
    while replicas.min_replicas is not None and time.monotonic() - started < timeout_s:
        if replicas.desired <= replicas.min_replicas and replicas.ready >= replicas.desired:
            break
        time.sleep(_WATCH_POLL_S * 5)
        replicas = run.target.replicas()
    waited_s = round(time.monotonic() - started, 2)
    # the watch's "before": the pulse's own action returns seconds later (its rate check),
    # by when the autoscaler may already have acted
    run.findings["replicas_at_rest"] = replicas
    if waited_s >= 1.0:
        run.notes.append(
            f"autoscaling: waited {waited_s} s for the pool to settle at its minimum "
            f"({replicas.desired} replicas, min {replicas.min_replicas}) before the pulse"
        )
    return waited_s


def watch_scale_out(run: ChaosRun, timeout_s: float = 60.0) -> dict[str, Any]:
    """Right after the load's pulse starts (its fault): read the GPU pool's replicas every
    0.5 s until the autoscaler has asked for more and as many are ready, or `timeout_s`. The
    times (from the pulse's start; a decision already made at the first read counts at that
    read) go to the run's findings and are returned. More than before: than the pool at rest
    (`settle_at_min_replicas`), else than the first read."""
    timeout_s = as_number("timeout_s", timeout_s)
    target = run.target
    pulse_ts = run.last_fault_ts() or time.time()
    before = run.findings.get("replicas_at_rest") or target.replicas()
    decided = ready = None
    peak = before.desired
    last = before
    while time.time() - pulse_ts < timeout_s:
        last = target.replicas()
        now = time.time() - pulse_ts
        peak = max(peak, last.desired)
        if decided is None and last.desired > before.desired:
            decided = now
        if decided is not None and last.ready >= last.desired:
            ready = now
            break
        time.sleep(_WATCH_POLL_S * 5)
    found = {
        "pulse_started_ts": round(pulse_ts, 3),
        "replicas_before": before.desired,
        "ready_before": before.ready,
        "autoscaled": before.autoscaled,
        "scale_out_decided_after_s": None if decided is None else round(decided, 2),
        "scale_out_ready_after_s": None if ready is None else round(ready, 2),
        "replicas_after_scale_out": last.desired,
        "ready_after_scale_out": last.ready,
        "replicas_peak": peak,
        "last_detail": last.detail,
    }
    run.findings["autoscaling"] = found
    run.notes.append(
        f"autoscaling: {before.desired} -> {last.desired} replicas, decided after "
        f"{found['scale_out_decided_after_s']} s, ready after {found['scale_out_ready_after_s']} s"
    )
    log.info("llmchaos: scale-out watch: %s", found)
    return found


def watch_scale_in(run: ChaosRun, timeout_s: float = 120.0) -> dict[str, Any]:
    """Right after the pulse ends (the load back at its base rate, the last fault): read the
    replicas every 0.5 s until the pool is back at its minimum (desired and ready), or
    `timeout_s`. Adds the time to the run's findings and returns them."""
    timeout_s = as_number("timeout_s", timeout_s)
    found = run.findings.setdefault("autoscaling", {})
    target = run.target
    end_ts = run.last_fault_ts() or time.time()
    floor = found.get("replicas_before")
    scaled_in = None
    last = target.replicas()
    while time.time() - end_ts < timeout_s:
        last = target.replicas()
        floor = last.min_replicas if last.min_replicas is not None else floor
        if floor is not None and last.desired <= floor and last.ready <= floor:
            scaled_in = time.time() - end_ts
            break
        time.sleep(_WATCH_POLL_S * 5)
    found.update(
        {
            "pulse_ended_ts": round(end_ts, 3),
            "scaled_in_after_s": None if scaled_in is None else round(scaled_in, 2),
            "replicas_at_end": last.desired,
            "min_replicas": floor,
        }
    )
    run.notes.append(
        f"autoscaling: back to {last.desired} replicas after {found['scaled_in_after_s']} s"
    )
    log.info("llmchaos: scale-in watch: %s", found)
    return found


def _autoscaling(run: ChaosRun) -> dict[str, Any] | None:
    return run.findings.get("autoscaling")


def scale_out_s(run: ChaosRun) -> float:
    """Seconds from the pulse's start until the replicas the autoscaler asked for were ready
    (0 before the method). Raises NotMeasured when it never scaled out."""
    found = _autoscaling(run)
    if found is None:
        return 0.0
    if found.get("scale_out_ready_after_s") is None:
        if found.get("scale_out_decided_after_s") is None:
            raise NotMeasured(
                f"the GPU pool stayed at {found['replicas_after_scale_out']} replicas through "
                f"the pulse (autoscaler {'on' if found['autoscaled'] else 'off'}; "
                f"{found['last_detail'] or 'no decision seen'})"
            )
        raise NotMeasured(
            f"the autoscaler asked for {found['replicas_after_scale_out']} replicas after "
            f"{found['scale_out_decided_after_s']} s, but only {found['ready_after_scale_out']} "
            "were ready when the watch ended"
        )
    return float(found["scale_out_ready_after_s"])


def scale_in_s(run: ChaosRun) -> float:
    """Seconds from the pulse's end until the pool was back at its minimum (0 before the
    method). Raises NotMeasured when it did not come back."""
    found = _autoscaling(run)
    if found is None or "pulse_ended_ts" not in found:
        return 0.0
    if found["scaled_in_after_s"] is None:
        raise NotMeasured(
            f"the GPU pool was still at {found['replicas_at_end']} replicas (minimum "
            f"{found['min_replicas']}) when the scale-in watch ended"
        )
    return float(found["scaled_in_after_s"])


def _pulse_window(run: ChaosRun) -> dict[str, Any] | None:
    """The requests scheduled during the pulse once it had scaled out (plus one SLO window
    for the new replicas' queues to clear), settled; None before the method."""
    found = _autoscaling(run)
    if found is None or "pulse_ended_ts" not in found:
        return None
    if found.get("scale_out_ready_after_s") is None:
        raise NotMeasured("the GPU pool never scaled out: there is no scaled pulse to judge")
    since = found["pulse_started_ts"] + found["scale_out_ready_after_s"] + run.settings.window_s
    until = found["pulse_ended_ts"]
    if until - since < 1.0:
        raise NotMeasured(
            f"the pulse ended {until - since + run.settings.window_s:.1f} s after the scale-out: "
            "hold it longer to judge the SLO at the new size"
        )
    return _settled_window(run, since, until)


def pulse_p99_ms(run: ChaosRun) -> float:
    """P99 latency of the pulse's requests at its scaled-out size (0 before the method)."""
    window = _pulse_window(run)
    if window is None:
        return 0.0
    return float(window["latency_with_unanswered_ms"]["p99"] or 0.0)


def pulse_error_rate(run: ChaosRun) -> float:
    """SLO error rate of the pulse's requests at its scaled-out size (0 before the method)."""
    window = _pulse_window(run)
    if window is None:
        return 0.0
    return window_error_rate(window, run.settings.error_classes)


def registry_has_leader(run: ChaosRun) -> bool:
    """Whether the registry's members know a leader now."""
    try:
        name = run.target.registry_leader()
    except StackError as exc:
        log.info("llmchaos: registry: %s", exc)
        return False
    log.info("llmchaos: registry leader: %s", name)
    return True


_SHARE_WINDOWS = 3
"""Windows worker_share_after_fault tries before it gives up on a worker that does not answer
both reads of its counters."""


def worker_share_after_fault(
    run: ChaosRun, worker: str, window_s: float = 0.0, of_fair_share: bool = False
) -> float:
    """Share of the requests the GPU workers took over the next `window_s` seconds (the run's
    window by default) that `worker` took: did routing shift load away from it? From the
    engines' own metrics: finished (vllm:request_success) plus in the engine (running and
    waiting), whose difference over the window counts arrivals even when an engine falls
    behind. Only workers whose counters answered at both ends of the window count; when
    `worker`'s did not, another window is measured, and after _SHARE_WINDOWS it raises
    NotMeasured (a throttled worker can take longer than the read's timeout to answer, and
    counting it as having taken nothing would pass the very routing that keeps feeding it).
    `of_fair_share`: as a multiple of 1/N, N the target's GPU workers (1: as much as any, 0:
    none), which means the same at any fleet size. 0 before any fault (nothing to judge yet),
    so it can sit in the steady-state hypothesis."""
    window_s = as_number("window_s", window_s) or run.settings.window_s
    if window_s < 0:
        raise InvalidInput(f"window_s: expected seconds >= 0, got {window_s}")
    info = run.target.info()
    (name,) = info.gpu_workers(worker, "")
    if run.last_fault_ts() is None:
        return 0.0
    gpus = {w.name for w in info.workers if w.mode == "gpu"}
    for attempt in range(1, _SHARE_WINDOWS + 1):
        before = run.target.requests_taken()
        if before is None:
            raise InvalidInput(
                f"worker_share_after_fault: the {run.settings.target} target "
                "cannot read its engines' request counters"
            )
        time.sleep(window_s)
        after = run.target.requests_taken() or {}
        done = {w: after[w] - before[w] for w in gpus if w in before and w in after}
        if name in done:
            break
        if attempt < _SHARE_WINDOWS:
            log.info("llmchaos: %s's counters did not answer both reads: measured again", name)
    else:
        raise NotMeasured(
            f"worker_share_after_fault: {name}'s engine did not answer both reads of its "
            f"request counters in {_SHARE_WINDOWS} windows of {window_s:g} s (throttled, "
            "partitioned or dead): its share of the traffic is unknown"
        )
    total = sum(max(0.0, n) for n in done.values())
    share = max(0.0, done[name]) / total if total else 0.0
    log.info(
        "llmchaos: %s finished %.0f of %.0f requests of %d GPU workers in %g s",
        name,
        done[name],
        total,
        len(done),
        window_s,
    )
    return round(share * len(gpus) if of_fair_share else share, 4)
