"""The master's merged view: windows, the summary, and timeline lines once they are final.

Worker reports come in through `add_report`; `window()` answers the live HTTP endpoint,
`summary()` the end of the run, `final_lines()` the incremental JSON-lines timeline and
`seconds_lines()` the same per-second records live (final or not); both are made by `line()`.
Plain Python (no gevent), so tests and the analysis use it directly.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from typing import Any

from llmchaos.load.histogram import LogHistogram
from llmchaos.load.timeline import FAILURE_CLASSES, SLOTS_PER_S, SecondStats, merge_report

__all__ = ["FRAME_DROP_S", "Aggregate", "frame_drop_events", "frame_drops", "quantiles"]

FRAME_DROP_S = 3.0
"""A frame drop: this long or longer without a successful response (the field's definition)."""
STALE_WORKER_S = 15.0
"""A worker silent this long no longer holds back finality of timeline seconds (it died)."""
_TS_SLACK_S = 0.001
"""Resolution of a line's "ts" (rounded to 1 ms)."""


def quantiles(h: LogHistogram) -> dict[str, float | None]:
    """p50/p90/p99/p999 of `h` rounded to 0.01, None when empty."""
    out: dict[str, float | None] = {}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999)):
        value = h.quantile(q)
        out[name] = None if value is None else round(value, 2)
    return out


def frame_drop_events(
    ok_slots: Counter[int], from_s: float, to_s: float
) -> list[tuple[float, float]]:
    """(start offset, length) in seconds of every gap >= FRAME_DROP_S between successes (by
    completion instant, 100 ms resolution) within [from_s, to_s); the window's edges count as
    edges of a gap."""
    instants = sorted(
        slot / SLOTS_PER_S for slot in ok_slots if from_s <= slot / SLOTS_PER_S < to_s
    )
    edges = [from_s, *instants, to_s]
    return [
        (round(a, 1), round(b - a, 1))
        for a, b in itertools.pairwise(edges)
        if b - a >= FRAME_DROP_S
    ]


def frame_drops(ok_slots: Counter[int], from_s: float, to_s: float) -> tuple[int, float]:
    """(count, total seconds) of the frame drops within [from_s, to_s)."""
    events = frame_drop_events(ok_slots, from_s, to_s)
    return len(events), round(sum(length for _, length in events), 1)


class Aggregate:
    """All worker reports of one run merged; `start_epoch_s` is the schedule's time zero.

    `goodput`: whether the run has goodput SLOs (else goodput figures are None). Rates are
    over the time the load really ran (`ran_s`): a run stopped early (by the control, or by
    its owner's death) divides by the seconds until the stop, never by the planned schedule.
    """

    def __init__(
        self, start_epoch_s: float, duration_s: float, target_qps: float, goodput: bool = False
    ) -> None:
        self.start_epoch_s = start_epoch_s
        self.duration_s = duration_s
        self.target_qps = target_qps
        self.goodput = goodput
        self.stopped_at_s: float | None = None
        """Schedule offset at which the run was stopped before its end; None if it was not."""
        self.seconds: dict[int, SecondStats] = {}
        self.ok_slots: Counter[int] = Counter()
        self._workers: dict[str, dict[str, Any]] = {}
        self._counts: dict[str, Counter[str]] = {}
        """Per worker (or lost share): scheduled, dropped, ok, failed, lost_worker."""
        self._lost_horizons: dict[str, int] = {}
        """Lost shares still being replayed: the second their counts are complete before."""
        self._awaited: set[str] = set()
        """Shares given to a worker that has not reported yet (`expect`)."""
        self._written_upto = 0  # seconds below this are already in the timeline file

    def expect(self, worker_id: str) -> None:
        """A worker has a share of the schedule: until its first report (or its loss) no
        second counts as scheduled in full, since that report may hold arrivals of any."""
        if worker_id not in self._workers:
            self._awaited.add(worker_id)

    def add_report(self, worker_id: str, report: dict[str, Any]) -> None:
        self._awaited.discard(worker_id)
        merge_report(self.seconds, self.ok_slots, report)
        counts = self._counts.setdefault(worker_id, Counter())
        for data in report["seconds"].values():
            counts["scheduled"] += data["scheduled"]
            counts["dropped"] += data["dropped"]
            counts["ok"] += data["ok"]
            counts["failed"] += sum(data["failed"].values())
        self._workers[worker_id] = {
            "in_flight": report["in_flight"],
            "complete_before_s": report["complete_before_s"],
            "scheduled_before_s": report["scheduled_before_s"],
            "final": report["final"],
            "seen": time.monotonic(),
            "at_s": self.now_s(),
            "lost": False,
            "scheduled_total": report.get("scheduled_total", 0),
        }

    def scheduled_total(self, worker_id: str) -> int:
        """Arrivals of its share that the worker's reports hold (0 before its first)."""
        worker = self._workers.get(worker_id)
        return 0 if worker is None else int(worker["scheduled_total"])

    def reported_since(self, worker_id: str, since_mono: float) -> bool:
        """Whether a report of the worker came at or after `since_mono` (time.monotonic)."""
        worker = self._workers.get(worker_id)
        return worker is not None and worker["seen"] >= since_mono

    def silent_s(self, worker_id: str) -> float:
        """Seconds since the worker's last report (since time zero if it sent none)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return self.now_s()
        return time.monotonic() - worker["seen"]

    def mark_lost(self, worker_id: str) -> None:
        """The worker is lost: its reports so far stay (its requests in flight then remain
        unanswered); it no longer holds back finality or the reported end of the run."""
        self._awaited.discard(worker_id)
        if worker_id in self._workers:
            self._workers[worker_id]["lost"] = True

    def add_lost(self, key: str, counts: Counter[int], position_s: float | None) -> None:
        """Count the arrivals of a lost share (`counts`: scheduled second -> arrivals) as
        scheduled and lost_worker. `position_s`: the replay counted everything before it
        (None: the share's schedule is over)."""
        totals = self._counts.setdefault(key, Counter())
        for sec, n in counts.items():
            stats = self.seconds.get(sec)
            if stats is None:
                stats = self.seconds[sec] = SecondStats()
            stats.scheduled += n
            stats.lost_worker += n
            totals["scheduled"] += n
            totals["lost_worker"] += n
        if position_s is None:
            self._lost_horizons.pop(key, None)
        else:
            self._lost_horizons[key] = int(position_s)

    def worker_counts(self, key: str) -> dict[str, int]:
        """scheduled, dropped, ok, failed, unanswered and lost_worker of one worker or share;
        they close: scheduled = dropped + ok + failed + unanswered + lost_worker."""
        c = self._counts.get(key, Counter())
        names = ("scheduled", "dropped", "ok", "failed", "lost_worker")
        out = {name: c[name] for name in names}
        out["unanswered"] = c["scheduled"] - c["dropped"] - c["ok"] - c["failed"] - c["lost_worker"]
        return out

    @property
    def in_flight(self) -> int:
        """Requests in flight at each worker's last report (a lost worker's: never answered)."""
        return sum(w["in_flight"] for w in self._workers.values())

    def now_s(self) -> float:
        return time.time() - self.start_epoch_s

    def mark_stopped(self, at_s: float | None = None) -> None:
        """Scheduling stopped at `at_s` (default now): the run's rates end there."""
        if self.stopped_at_s is None:
            self.stopped_at_s = max(0.0, self.now_s() if at_s is None else at_s)

    def ran_s(self) -> float:
        """Seconds of schedule that really ran: up to the stop, the end, or now."""
        end_s = self.now_s() if self.stopped_at_s is None else self.stopped_at_s
        return max(0.0, min(self.duration_s, end_s))

    def _per_s(self, count: int, span_s: float) -> float:
        return round(count / span_s, 2) if span_s > 0 else 0.0

    def _merged(self, from_s: float, to_s: float) -> SecondStats:
        out = SecondStats()
        for sec, stats in self.seconds.items():
            if from_s <= sec < to_s:
                out.merge(stats)
        return out

    def window(self, from_s: float, to_s: float) -> dict[str, Any]:
        """Stats of the requests scheduled in [from_s, to_s) (offsets in seconds)."""
        from_s = max(from_s, 0.0)
        # Seconds are keyed by their start: [from_s, to_s) holds the seconds from ceil(from_s);
        # the current second counts only as far as the schedule has got.
        span_s = max(min(math.ceil(to_s), self.now_s()) - math.ceil(from_s), 1e-9)
        m = self._merged(from_s, to_s)
        done = m.done
        events = frame_drop_events(self.ok_slots, from_s, min(to_s, self.now_s()))
        answered_modes = sum(m.modes.values())
        last_ok = max(self.ok_slots) / SLOTS_PER_S if self.ok_slots else None
        return {
            "from_s": round(from_s, 3),
            "to_s": round(to_s, 3),
            "from_ts": round(self.start_epoch_s + from_s, 3),
            "scheduled": m.scheduled,
            "ok": m.ok,
            "failed": {c: m.failed.get(c, 0) for c in FAILURE_CLASSES},
            "dropped": m.dropped,
            "lost_worker": m.lost_worker,
            "in_flight": m.unanswered,
            "achieved_qps": round(done / span_s, 2),
            "ok_qps": round(m.ok / span_s, 2),
            "goodput_qps": round(m.good / span_s, 2) if self.goodput else None,
            "ok_completed_qps": self._ok_completed_qps(from_s, to_s),
            "output_tokens_per_s": round(m.output_tokens / span_s, 2),
            "error_rate": round(sum(m.failed.values()) / done, 5) if done else 0.0,
            "error_rate_by_class": {
                c: round(m.failed.get(c, 0) / done, 5) if done else 0.0 for c in FAILURE_CLASSES
            },
            "latency_ms": quantiles(m.hist["latency_ms"]),
            "latency_with_unanswered_ms": quantiles(self._with_unanswered(from_s, to_s, m)),
            "ttft_ms": quantiles(m.hist["ttft_ms"]),
            "itl_ms": quantiles(m.hist["itl_ms"]),
            "tpot_ms": quantiles(m.hist["tpot_ms"]),
            "schedule_lag_ms": quantiles(m.hist["lag_ms"]),
            "frame_drops": len(events),
            "frame_drop_s": round(sum(length for _, length in events), 1),
            "frame_drop_events": [list(event) for event in events],
            "seconds_since_last_ok": None if last_ok is None else round(self.now_s() - last_ok, 1),
            "serving_mode_share": {
                mode: round(n / answered_modes, 4) for mode, n in m.modes.items()
            },
            "tenants": dict(m.tenants),
        }

    def _with_unanswered(self, from_s: float, to_s: float, merged: SecondStats) -> LogHistogram:
        """The window's latencies plus each request still unanswered at the last reports,
        counted at a lower bound of its age. Answered latencies alone are capped by how long
        one waited before reading: a saturated target's slowest requests are the ones missing.

        Every worker had them unanswered at its own last report, so the oldest of those report
        times, minus the end of the request's scheduled second, is a floor of their latency.
        """
        out = LogHistogram.merged([merged.hist["latency_ms"]])
        if not self._workers:
            return out
        reported_s = min(w["at_s"] for w in self._workers.values())
        for sec, stats in self.seconds.items():
            if from_s <= sec < to_s:
                unanswered = stats.unanswered
                if unanswered > 0:
                    out.add(max(0.0, (reported_s - (sec + 1)) * 1000.0), unanswered)
        return out

    def _ok_completed_qps(self, from_s: float, to_s: float) -> float:
        """Successes per second by *completion* time in [from_s, to_s): the throughput the
        target delivered then (the other rates are keyed by scheduled time)."""
        end_s = min(to_s, self.now_s())
        if end_s <= from_s:
            return 0.0
        lo, hi = math.ceil(from_s * SLOTS_PER_S), math.ceil(end_s * SLOTS_PER_S)
        n = sum(count for slot, count in self.ok_slots.items() if lo <= slot < hi)
        return round(n / ((hi - lo) / SLOTS_PER_S), 2)

    def summary(self) -> dict[str, Any]:
        """The end-of-run summary (`--summary-json`); accounting is checked, not assumed."""
        m = self._merged(0, float("inf"))
        failed = {c: m.failed.get(c, 0) for c in FAILURE_CLASSES}
        in_flight = self.in_flight
        done = m.done
        ran_s = self.ran_s()
        events = frame_drop_events(self.ok_slots, 0.0, ran_s)
        lag_p99 = m.hist["lag_ms"].quantile(0.99)
        return {
            "scheduled": m.scheduled,
            "ok": m.ok,
            "failed": failed,
            "dropped": m.dropped,
            "lost_worker": m.lost_worker,
            "in_flight": in_flight,
            "accounting_closed": m.scheduled
            == m.ok + sum(failed.values()) + m.dropped + in_flight + m.lost_worker,
            "duration_s": self.duration_s,
            "ran_s": round(ran_s, 3),
            "stopped_early": self.stopped_at_s is not None and self.stopped_at_s < self.duration_s,
            "target_qps": self.target_qps,
            "achieved_qps": self._per_s(done, ran_s),
            "goodput_qps": self._per_s(m.good, ran_s) if self.goodput else None,
            "output_tokens_per_s": self._per_s(m.output_tokens, ran_s),
            "schedule_lag_p99_ms": None if lag_p99 is None else round(lag_p99, 2),
            "schedule_lag_ms": quantiles(m.hist["lag_ms"]),
            "latency_ms": quantiles(m.hist["latency_ms"]),
            "ttft_ms": quantiles(m.hist["ttft_ms"]),
            "itl_ms": quantiles(m.hist["itl_ms"]),
            "tpot_ms": quantiles(m.hist["tpot_ms"]),
            "frame_drops": len(events),
            "frame_drop_s": round(sum(length for _, length in events), 1),
            "frame_drop_events": [list(event) for event in events],
            "serving_modes": dict(m.modes),
        }

    def _final_upto(self) -> int:
        """Seconds below this are final: no live worker can still change them (and those
        already written to the timeline are final whatever happened to their workers). A
        share whose worker has not reported yet holds every second back, as in
        _scheduled_upto_s: its first report may hold any of them (a worker slow to start on a
        busy machine once had its first second written without it, 64 requests short)."""
        if self._awaited:
            return self._written_upto
        now = time.monotonic()
        live = [
            w for w in self._workers.values() if now - w["seen"] < STALE_WORKER_S and not w["lost"]
        ]
        if not live and not self._lost_horizons:
            return self._written_upto
        # A worker with nothing open and nothing left to schedule reports None.
        horizons = [w["complete_before_s"] for w in live if w["complete_before_s"] is not None]
        horizons += self._lost_horizons.values()
        upto = min(horizons) if horizons else max(self.seconds, default=-1) + 1
        return max(upto, self._written_upto)

    def _scheduled_upto_s(self) -> float:
        """Schedule offset before which every arrival of every share is in the reports: a
        second ending there has all its requests counted (answered or not). A silent worker,
        or one yet to send its first report, still holds it back (its reports may yet come);
        a lost one's share counts as replayed."""
        horizons = [
            math.inf if w["scheduled_before_s"] is None else float(w["scheduled_before_s"])
            for w in self._workers.values()
            if not w["lost"]
        ]
        horizons += self._lost_horizons.values()
        upto = 0.0 if self._awaited or not horizons else min(horizons)
        return max(upto, float(self._written_upto))

    def line(self, sec: int, stats: SecondStats) -> dict[str, Any]:
        """The record of scheduled second `sec`: one timeline line, one item of /seconds.

        `unanswered` (scheduled - dropped - lost_worker - answered, as of the last reports)
        closes the accounting of the line; in a final line it is normally 0, else requests of a
        worker that died with them in flight or did not drain.
        """
        line = {"t": sec, "ts": round(self.start_epoch_s + sec, 3), **stats.to_json()}
        line["unanswered"] = stats.unanswered
        line["latency_ms"] = quantiles(stats.hist["latency_ms"])
        for name in ("ttft_ms", "itl_ms", "tpot_ms"):
            line[name] = quantiles(stats.hist[name])
        line["schedule_lag_ms"] = quantiles(stats.hist["lag_ms"])
        return line

    def final_lines(self, flush_all: bool = False) -> list[dict[str, Any]]:
        """Timeline lines for seconds no live worker can still change (all when `flush_all`)."""
        upto = max(self.seconds, default=-1) + 1 if flush_all else self._final_upto()
        lines = [
            self.line(sec, self.seconds[sec])
            for sec in range(self._written_upto, upto)
            if sec in self.seconds
        ]
        self._written_upto = max(self._written_upto, upto)
        return lines

    def seconds_lines(self, from_s: float, to_s: float) -> list[dict[str, Any]]:
        """Records of the seconds starting in [from_s, to_s), final or not (live data), by t.

        Each is `line()` plus "final": true once no live worker can change it any more, and
        "scheduled_in_full": true once every request scheduled in it is counted (answered or
        not), so a reader can judge it before it is final.
        Seconds in which nothing was scheduled have no record, as in the timeline. The bounds
        are compared 1 ms early: a line's "ts" is rounded to 1 ms, and a reader passing it back
        as since_ts (or until_ts) must get that line (or not) whichever way it was rounded.
        """
        upto, scheduled_upto = self._final_upto(), self._scheduled_upto_s()
        lo, hi = from_s - _TS_SLACK_S, to_s - _TS_SLACK_S
        return [
            {
                **self.line(sec, self.seconds[sec]),
                "final": sec < upto,
                "scheduled_in_full": sec + 1 <= scheduled_upto,
            }
            for sec in sorted(self.seconds)
            if lo <= sec < hi
        ]
