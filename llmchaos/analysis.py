"""Recovery and fault impact, computed from the load's per-second records.

Vocabulary (DESIGN.md):

- fault time t0: the moment the (last) fault's action started;
- a window: `window_s` consecutive scheduled seconds; it *meets the SLO* when all its requests
  are settled (answered, timed out or dropped), at least one was answered, its P99 latency is
  at most `p99_ms` and its error rate at most `error_rate`. The error rate counts the SLO's
  failure classes plus dropped sends, over answered plus dropped;
- a window *certainly misses* the SLO when it will miss it whatever its unanswered requests
  turn out to be: every one of them will be answered (they all count in the P99, at some
  latency >= 0) or the window never settles. Live judging needs this to see a miss as soon as
  it is sure, not only once the last request of a stalled window timed out;
- a window *certainly meets* the SLO when it will meet it even if every unanswered request
  fails, slower than any answer: the few slowest requests of a window at thousands of QPS
  need not be waited for (they would hold the verdict up by their timeout);
- detection: the end of the first window after t0 that misses the SLO;
- recovered at t1: the service holds the SLO from t1 on, for `stable_for_s`: the first run of
  `stable_for_s` consecutive windows (one ending at each second) that all meet the SLO, and t1
  is the start of the first window of that run — the moment from which the requests were
  fine again. recovery time = t1 - t0, never negative; 0 when no window after the fault
  missed the SLO before the run started. A fault that keeps acting by itself for a while (a
  surge of `duration_s`, or a throttle or a hang held for `hold_s`) is recovered from only by
  a run that lasts until the fault stops (its last window starts at that moment or later):
  its harm may build up slowly, or come back when a gateway readmits a hung worker, and a run
  that ended before it did would say recovered about a fault still under way.

Windows are keyed by the second a request was *scheduled* in (open-loop load), so a request
that waited out a stall counts where it was due, not where it finished.

Pure functions over plain data: the recovery probe feeds them live records, the report the
timeline file, the tests synthetic timelines.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmchaos.load.histogram import LogHistogram

__all__ = [
    "SLO_ERROR_CLASSES",
    "FaultImpact",
    "Recovery",
    "SecondRecord",
    "Slo",
    "WindowVerdict",
    "fault_impact",
    "read_timeline",
    "recovery",
    "rolling_windows",
    "tenant_latency",
]


SLO_ERROR_CLASSES = ("5xx", "429", "timeout", "connection", "bad_body")
"""Outcomes that fail the SLO by default: every load failure class but other 4xx (the
client's fault, a revoked token)."""


@dataclass(frozen=True)
class Slo:
    """What a window must meet."""

    p99_ms: float
    error_rate: float
    error_classes: tuple[str, ...] = SLO_ERROR_CLASSES


@dataclass
class SecondRecord:
    """The requests scheduled in one second (a timeline line, or an item of the live /seconds)."""

    ts: int
    """Epoch second the requests were scheduled in."""
    scheduled: int = 0
    ok: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    unanswered: int = 0
    """Still in flight when the record was read (0 in a finished timeline)."""
    lost_worker: int = 0
    """Arrivals of a load worker that was lost before it sent them (distributed load)."""
    modes: dict[str, int] = field(default_factory=dict)
    latency: LogHistogram = field(default_factory=LogHistogram)
    stream_p99_ms: dict[str, float | None] = field(default_factory=dict)
    """P99 of the streams' "ttft_ms", "itl_ms", "tpot_ms" in this second (for the report)."""
    tenant_latency: dict[str, LogHistogram] = field(default_factory=dict)
    """Each tenant's latencies (end to end, answered requests) in this second."""
    scheduled_in_full: bool | None = None
    """Live data: whether every load worker has reported its share of this second (None: not
    said, as in a timeline file)."""

    @property
    def answered(self) -> int:
        return self.ok + sum(self.failed.values())

    @classmethod
    def from_line(cls, line: dict[str, Any]) -> SecondRecord:
        """From a timeline line or a /seconds item (extra keys are ignored)."""
        hist = line.get("hist", {}).get("latency_ms")
        return cls(
            ts=math.floor(float(line["ts"]) + 1e-6),
            scheduled=int(line.get("scheduled", 0)),
            ok=int(line.get("ok", 0)),
            failed={str(k): int(v) for k, v in line.get("failed", {}).items()},
            dropped=int(line.get("dropped", 0)),
            unanswered=int(line.get("unanswered", 0)),
            lost_worker=int(line.get("lost_worker", 0)),
            modes={str(k): int(v) for k, v in line.get("modes", {}).items()},
            latency=LogHistogram.from_json(hist) if hist else LogHistogram(),
            stream_p99_ms={
                name: (line.get(name) or {}).get("p99") for name in ("ttft_ms", "itl_ms", "tpot_ms")
            },
            tenant_latency={
                str(t): LogHistogram.from_json(h) for t, h in line.get("tenant_hist", {}).items()
            },
            scheduled_in_full=line.get("scheduled_in_full"),
        )


def read_timeline(path: Path) -> list[SecondRecord]:
    """Records of a JSON-lines timeline file; a last line cut off by a kill is skipped."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "ts" in data:
            records.append(SecondRecord.from_line(data))
    return records


@dataclass(frozen=True)
class WindowVerdict:
    """One rolling window, ending with the second that starts at `end_ts - 1`."""

    start_ts: int
    end_ts: int
    """Exclusive end (epoch seconds)."""
    answered: int
    p99_ms: float | None
    error_rate: float
    settled: bool
    meets_slo: bool
    """Meets the SLO whatever its unanswered requests bring (settled or not; module
    docstring)."""
    certain_miss: bool
    """Misses the SLO whatever its unanswered requests bring (module docstring)."""


def _dense(records: Iterable[SecondRecord]) -> list[SecondRecord]:
    """One record per second from the first to the last, empty seconds filled in."""
    by_ts = {r.ts: r for r in records}
    if not by_ts:
        return []
    first, last = min(by_ts), max(by_ts)
    return [by_ts.get(ts) or SecondRecord(ts=ts) for ts in range(first, last + 1)]


def _failures(record: SecondRecord, slo: Slo) -> int:
    return sum(n for cls, n in record.failed.items() if cls in slo.error_classes)


def rolling_windows(
    records: Sequence[SecondRecord], slo: Slo, window_s: float, now_ts: float | None = None
) -> list[WindowVerdict]:
    """One verdict per second: the window of `window_s` seconds ending with it.

    With `now_ts` (live data), a second counts as unsettled until every load worker has
    reported its share of it (`scheduled_in_full`, of the second or of the next one with a
    record; records that do not say: until 2 s after its end), since their reports may still
    add requests to it.
    """
    seconds = _dense(records)
    # a second with no record (nothing scheduled in it, so far as the reports say) is reported
    # in full when the next second with a record is: the load's horizon only moves forward
    in_full: list[bool | None] = []
    following: bool | None = None
    for record in reversed(seconds):
        if record.scheduled_in_full is not None:
            following = record.scheduled_in_full
        in_full.append(following)
    in_full.reverse()
    width = max(1, round(window_s))
    out = []
    for i, last in enumerate(seconds):
        part = seconds[max(0, i - width + 1) : i + 1]
        answered = sum(r.answered for r in part)
        dropped = sum(r.dropped for r in part)
        unanswered = sum(r.unanswered for r in part)
        failures = sum(_failures(r, slo) for r in part) + dropped
        error_rate = failures / (answered + dropped) if answered + dropped else 0.0
        latency = LogHistogram.merged(r.latency for r in part)
        p99 = latency.quantile(0.99)
        reported_in_full = (
            now_ts is None or in_full[i] or (in_full[i] is None and last.ts + 1 <= now_ts - 2.0)
        )
        settled = unanswered == 0 and reported_in_full
        meets = (
            settled
            and answered > 0
            and p99 is not None
            and p99 <= slo.p99_ms
            and error_rate <= slo.error_rate
        )
        if settled:
            certain_miss = not meets
        elif reported_in_full and unanswered:
            # the worst the unanswered can do: all fail, slower than any answer
            worst = LogHistogram.merged((latency,))
            worst.add(2 * slo.p99_ms if math.isfinite(slo.p99_ms) else 0.0, unanswered)
            worst_p99 = worst.quantile(0.99) or 0.0
            worst_error_rate = (failures + unanswered) / (answered + dropped + unanswered)
            meets = answered > 0 and worst_p99 <= slo.p99_ms and worst_error_rate <= slo.error_rate
            # the best they can do: all answered, at once and without error
            latency.add(0.0, unanswered)
            floor_p99 = latency.quantile(0.99) or 0.0
            floor_error_rate = failures / (answered + dropped + unanswered)
            certain_miss = floor_p99 > slo.p99_ms or floor_error_rate > slo.error_rate
        else:
            certain_miss = False
        out.append(
            WindowVerdict(
                start_ts=part[0].ts,
                end_ts=last.ts + 1,
                answered=answered,
                p99_ms=None if p99 is None else round(p99, 2),
                error_rate=round(error_rate, 5),
                settled=settled,
                meets_slo=meets,
                certain_miss=certain_miss,
            )
        )
    return out


@dataclass(frozen=True)
class Recovery:
    """When the service held its SLO again after a fault."""

    fault_ts: float
    recovered: bool
    recovery_time_s: float | None
    """t1 - t0 in seconds; None when not (yet) recovered."""
    recovered_at_ts: float | None
    """t1: start of the first window of the stable run."""
    detected_at_ts: float | None
    """End of the first window after the fault that missed the SLO; None if none did."""
    judged_until_ts: float | None
    """End of the last window judged (settled, or certain to meet or to miss)."""
    earliest_recovery_s: float | None
    """The soonest recovery time the records still allow (= recovery_time_s once recovered):
    a run of good windows can only start after the last judged miss. None with no windows."""


def recovery(
    records: Sequence[SecondRecord],
    fault_ts: float,
    slo: Slo,
    *,
    window_s: float = 5.0,
    stable_for_s: float = 10.0,
    now_ts: float | None = None,
    active_until_ts: float | None = None,
) -> Recovery:
    """Recovery after the fault at `fault_ts`, acting by itself until `active_until_ts` (None:
    its action is the whole of it); see the module docstring for the definition."""
    windows = [
        w
        for w in rolling_windows(records, slo, window_s, now_ts)
        if w.end_ts - 1 >= math.floor(fault_ts)
    ]
    needed = max(1, math.ceil(stable_for_s))
    run_start: int | None = None
    detected: float | None = None
    judged_until: float | None = None
    judged = 0
    for index, window in enumerate(windows):
        if not (window.settled or window.meets_slo or window.certain_miss):
            break
        judged, judged_until = index + 1, window.end_ts
        if not window.meets_slo:
            run_start = None
            if detected is None:
                detected = window.end_ts
            continue
        if run_start is None:
            run_start = index
        if index - run_start + 1 >= needed and (
            active_until_ts is None or window.start_ts >= math.floor(active_until_ts)
        ):
            if detected is None:
                return Recovery(fault_ts, True, 0.0, fault_ts, None, judged_until, 0.0)
            t1 = max(float(windows[run_start].start_ts), fault_ts)
            time_s = round(t1 - fault_ts, 3)
            return Recovery(fault_ts, True, time_s, t1, detected, judged_until, time_s)
    # the next possible run starts with the current good run, or after the last judged window
    first = run_start if run_start is not None else judged
    if not windows:
        earliest = None
    elif first < len(windows):
        earliest = max(windows[first].start_ts - fault_ts, 0.0)
    else:
        earliest = max(windows[-1].start_ts + 1 - fault_ts, 0.0)
    return Recovery(fault_ts, False, None, None, detected, judged_until, earliest)


@dataclass(frozen=True)
class FaultImpact:
    """What the fault cost, from the fault to the end of the records."""

    worst_p99_ms: float | None
    """Highest P99 of a rolling window after the fault."""
    peak_error_rate: float
    """Highest error rate of a rolling window after the fault."""
    failed_requests: int
    """Failures (SLO classes) plus dropped sends of the requests scheduled from `in_flight_s`
    before the fault (those may have been in flight when it hit) until `until_ts` (the report
    passes the end of the stable run that confirmed recovery, or none: the end): the error
    budget the fault burned."""
    cpu_mode_s: int
    """Seconds after the fault in which most answers came from CPU workers."""
    cpu_answers: int
    """Answers served by CPU workers after the fault."""
    gpu_return_s: float | None
    """From the fault until the end of the last CPU-mode second: when traffic was back on
    GPU. None when the service never served mostly from CPU."""


def fault_impact(
    records: Sequence[SecondRecord],
    fault_ts: float,
    slo: Slo,
    *,
    window_s: float = 5.0,
    until_ts: float | None = None,
    in_flight_s: float = 0.0,
) -> FaultImpact:
    """Impact of the fault at `fault_ts`; failures are counted from `in_flight_s` before it
    up to `until_ts` (recovery)."""
    first = math.floor(fault_ts)
    dense = _dense(records)
    after = [r for r in dense if r.ts >= first]
    windows = [w for w in rolling_windows(records, slo, window_s) if w.end_ts - 1 >= first]
    p99s = [w.p99_ms for w in windows if w.p99_ms is not None]
    failed = sum(
        _failures(r, slo) + r.dropped
        for r in dense
        if r.ts >= math.floor(fault_ts - in_flight_s) and (until_ts is None or r.ts < until_ts)
    )
    cpu_seconds = [r.ts for r in after if r.modes.get("cpu", 0) * 2 > sum(r.modes.values()) > 0]
    return FaultImpact(
        worst_p99_ms=max(p99s) if p99s else None,
        peak_error_rate=max((w.error_rate for w in windows), default=0.0),
        failed_requests=failed,
        cpu_mode_s=len(cpu_seconds),
        cpu_answers=sum(r.modes.get("cpu", 0) for r in after),
        gpu_return_s=round(cpu_seconds[-1] + 1 - fault_ts, 3) if cpu_seconds else None,
    )


def tenant_latency(
    records: Sequence[SecondRecord], since_ts: float | None = None
) -> dict[str, dict[str, float | int | None]]:
    """Each tenant's answered requests and their P50/P99 latency (end to end from the
    scheduled send time, the load's definition) over the records scheduled from `since_ts`
    (all when None), by tenant name: whose requests a fault hurt (jitter attribution)."""
    merged: dict[str, LogHistogram] = {}
    for record in records:
        if since_ts is not None and record.ts + 1 <= since_ts:
            continue
        for tenant, hist in record.tenant_latency.items():
            merged.setdefault(tenant, LogHistogram()).merge(hist)
    return {
        tenant: {
            "requests": hist.count,
            "p50_ms": _rounded(hist.quantile(0.5)),
            "p99_ms": _rounded(hist.quantile(0.99)),
        }
        for tenant, hist in sorted(merged.items())
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
