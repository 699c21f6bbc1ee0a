"""Per-second records keyed by scheduled time, on the workers (Recorder) and merged (Timeline).

A request belongs to the second in which it was *scheduled*, whatever happened to it later: a
request due at t=12.3 s that waited out a 3 s stall lands in second 12 with 3 s of latency. The
workers send deltas of their records every report interval; the master adds them up. Everything
here is plain Python (no gevent), so the analysis can reuse it on a timeline file.

Outcome classes: "ok" and the failure classes in FAILURE_CLASSES; besides them, arrivals are
"dropped" (over the in-flight cap, never sent) or "lost_worker": the master's count of the
arrivals of a worker's share that no report of that worker holds (it never joined, or died or
went silent mid-run; process.py). They are in "scheduled" too, so a second's accounting closes:
scheduled = dropped + answered + unanswered + lost_worker. Latency histograms hold every
answered request (ok or failed; a timeout at its elapsed time) from its scheduled send time.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from llmchaos.load.histogram import LogHistogram

__all__ = ["FAILURE_CLASSES", "HISTOGRAMS", "Recorder", "SecondStats", "merge_report"]

FAILURE_CLASSES = ("5xx", "429", "timeout", "connection", "bad_body", "4xx")
HISTOGRAMS = ("latency_ms", "ttft_ms", "itl_ms", "tpot_ms", "lag_ms")
"""End to end, time to first token, inter-token gaps, time per output token (responses.py says
how each is measured), and send lag."""
SLOTS_PER_S = 10
"""Resolution of the success instants used for frame drops (100 ms)."""


class SecondStats:
    """Counts and histograms of the requests scheduled in one second."""

    __slots__ = (
        "dropped",
        "failed",
        "good",
        "hist",
        "lost_worker",
        "modes",
        "ok",
        "output_tokens",
        "scheduled",
        "tenant_ms",
        "tenants",
    )

    def __init__(self) -> None:
        self.scheduled = 0
        self.dropped = 0
        self.lost_worker = 0
        """Arrivals of a lost worker's share that it never reported (counted by the master)."""
        self.ok = 0
        self.good = 0
        """Successes that met every SLO of the run's goodput (DistServe's definition)."""
        self.output_tokens = 0
        """Output tokens of the successes (usage, else counted chunks; plain answers without
        usage count none)."""
        self.failed: Counter[str] = Counter()
        self.modes: Counter[str] = Counter()
        self.tenants: Counter[str] = Counter()
        self.tenant_ms: dict[str, LogHistogram] = {}
        """End-to-end latency of each tenant's answered requests (per-tenant P99: jitter
        attributed by tenant)."""
        self.hist = {name: LogHistogram() for name in HISTOGRAMS}

    @property
    def done(self) -> int:
        return self.ok + sum(self.failed.values())

    @property
    def unanswered(self) -> int:
        """Sent and not answered (yet, or ever: a worker that died with them in flight)."""
        return self.scheduled - self.dropped - self.lost_worker - self.done

    def merge(self, other: SecondStats) -> None:
        self.scheduled += other.scheduled
        self.dropped += other.dropped
        self.lost_worker += other.lost_worker
        self.ok += other.ok
        self.good += other.good
        self.output_tokens += other.output_tokens
        self.failed.update(other.failed)
        self.modes.update(other.modes)
        self.tenants.update(other.tenants)
        for tenant, hist in other.tenant_ms.items():
            self.tenant_ms.setdefault(tenant, LogHistogram()).merge(hist)
        for name in HISTOGRAMS:
            self.hist[name].merge(other.hist[name])

    def to_json(self) -> dict[str, Any]:
        return {
            "scheduled": self.scheduled,
            "dropped": self.dropped,
            "lost_worker": self.lost_worker,
            "ok": self.ok,
            "good": self.good,
            "output_tokens": self.output_tokens,
            "failed": dict(self.failed),
            "modes": dict(self.modes),
            "tenants": dict(self.tenants),
            "hist": {name: h.to_json() for name, h in self.hist.items() if h.count},
            "tenant_hist": {tenant: h.to_json() for tenant, h in self.tenant_ms.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SecondStats:
        out = cls()
        out.scheduled = int(data["scheduled"])
        out.dropped = int(data["dropped"])
        out.lost_worker = int(data.get("lost_worker", 0))
        out.ok = int(data["ok"])
        out.good = int(data.get("good", 0))
        out.output_tokens = int(data.get("output_tokens", 0))
        out.failed.update(data["failed"])
        out.modes.update(data["modes"])
        out.tenants.update(data["tenants"])
        for name, h in data["hist"].items():
            out.hist[name] = LogHistogram.from_json(h)
        for tenant, h in data.get("tenant_hist", {}).items():
            out.tenant_ms[tenant] = LogHistogram.from_json(h)
        return out


class Recorder:
    """One worker's records since the last report, plus what it still has open."""

    def __init__(self) -> None:
        self._seconds: dict[int, SecondStats] = {}
        self._ok_slots: Counter[int] = Counter()
        self._open: Counter[int] = Counter()  # scheduled second -> requests not yet finished
        self.in_flight = 0
        self.scheduled_total = 0
        """Arrivals taken from the schedule so far: a lost worker's replay skips these."""

    def _second(self, sec: int) -> SecondStats:
        stats = self._seconds.get(sec)
        if stats is None:
            stats = self._seconds[sec] = SecondStats()
        return stats

    def scheduled(self, sec: int) -> None:
        self._second(sec).scheduled += 1
        self._open[sec] += 1
        self.scheduled_total += 1

    def dropped(self, sec: int) -> None:
        self._second(sec).dropped += 1
        self._close(sec)

    def launched(self) -> None:
        """A send was handed to its greenlet (it counts against the in-flight cap now)."""
        self.in_flight += 1

    def sent(self, sec: int, lag_ms: float) -> None:
        self._second(sec).hist["lag_ms"].add(lag_ms)

    def finished(
        self,
        sec: int,
        outcome: str,
        latency_ms: float,
        done_offset_s: float,
        *,
        ttft_ms: float | None = None,
        itl_ms: list[float] | None = None,
        tpot_ms: float | None = None,
        output_tokens: int | None = None,
        good: bool = False,
        mode: str | None = None,
        tenant: str = "",
    ) -> None:
        """Record the end of a sent request; `outcome` is "ok" or a failure class, `good` says
        it met every goodput SLO. Stream timings count for successes only."""
        stats = self._second(sec)
        hist = stats.hist
        if outcome == "ok":
            stats.ok += 1
            self._ok_slots[int(done_offset_s * SLOTS_PER_S)] += 1
            if good:
                stats.good += 1
            if output_tokens:
                stats.output_tokens += output_tokens
            if ttft_ms is not None:
                hist["ttft_ms"].add(ttft_ms)
            if tpot_ms is not None:
                hist["tpot_ms"].add(tpot_ms)
            if itl_ms:
                itl = hist["itl_ms"]
                for gap in itl_ms:
                    itl.add(gap)
        else:
            stats.failed[outcome] += 1
        hist["latency_ms"].add(latency_ms)
        if mode:
            stats.modes[mode] += 1
        if tenant:
            stats.tenants[tenant] += 1
            tenant_hist = stats.tenant_ms.get(tenant)
            if tenant_hist is None:
                tenant_hist = stats.tenant_ms[tenant] = LogHistogram()
            tenant_hist.add(latency_ms)
        self.in_flight -= 1
        self._close(sec)

    def _close(self, sec: int) -> None:
        self._open[sec] -= 1
        if self._open[sec] <= 0:
            del self._open[sec]

    def take_report(self, next_due_s: float | None, final: bool = False) -> dict[str, Any]:
        """The delta since the last report (and reset). `next_due_s`: the schedule position.

        `complete_before_s` tells the master which seconds this worker will not touch again;
        `scheduled_before_s` before which schedule offset every arrival of its share is in its
        reports (None: all of them, the schedule is over); `scheduled_total` how many arrivals
        of its share all its reports hold together.
        """
        horizon = [min(self._open)] if self._open else []
        if next_due_s is not None:
            horizon.append(int(next_due_s))
        report = {
            "seconds": {str(sec): s.to_json() for sec, s in self._seconds.items()},
            "ok_slots": {str(slot): n for slot, n in self._ok_slots.items()},
            "in_flight": self.in_flight,
            "complete_before_s": min(horizon) if horizon else None,
            "scheduled_before_s": next_due_s,
            "scheduled_total": self.scheduled_total,
            "final": final,
        }
        self._seconds = {}
        self._ok_slots = Counter()
        return report


def merge_report(
    seconds: dict[int, SecondStats], ok_slots: Counter[int], report: dict[str, Any]
) -> None:
    """Add a worker report into the master's `seconds` and `ok_slots`."""
    for key, data in report["seconds"].items():
        sec = int(key)
        target = seconds.get(sec)
        if target is None:
            target = seconds[sec] = SecondStats()
        target.merge(SecondStats.from_json(data))
    for key, n in report["ok_slots"].items():
        ok_slots[int(key)] += n
