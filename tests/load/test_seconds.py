"""Per-second records: the timeline lines and /seconds come from one function, live and final."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from llmchaos.load.aggregate import Aggregate
from llmchaos.load.live import make_app
from llmchaos.load.timeline import Recorder, SecondStats

START = 1_700_000_000.0006
"""Time zero whose seconds' "ts" round up (…001.001): since_ts=ts must still select them."""


def _two_seconds() -> tuple[Aggregate, Recorder]:
    """Second 0: 3 scheduled, 1 dropped, 2 ok. Second 1: 2 scheduled, 1 timeout, 1 open."""
    agg = Aggregate(START, duration_s=2.0, target_qps=2.5)
    rec = Recorder()
    for _ in range(3):
        rec.scheduled(0)
    rec.dropped(0)
    for _ in range(2):
        rec.launched()
        rec.sent(0, 0.5)
        rec.finished(0, "ok", 12.0, 0.3, mode="gpu", tenant="alpha")
    for _ in range(2):
        rec.scheduled(1)
        rec.launched()
        rec.sent(1, 0.7)
    rec.finished(1, "timeout", 8000.0, 9.1, tenant="alpha")
    agg.add_report("w1", rec.take_report(next_due_s=1.5))
    return agg, rec


def test_seconds_include_unsettled_seconds_and_match_the_timeline_lines():
    agg, rec = _two_seconds()
    live = agg.seconds_lines(0.0, 10.0)
    assert [x["t"] for x in live] == [0, 1]
    first, second = live
    assert (first["scheduled"], first["dropped"], first["ok"], first["unanswered"]) == (3, 1, 2, 0)
    assert first["final"] and not second["final"]  # the worker still has second 1 open
    assert second["failed"] == {"timeout": 1} and second["unanswered"] == 1
    assert first["latency_ms"]["p50"] == 12.0 and first["modes"] == {"gpu": 2}
    assert set(first["hist"]) == {"latency_ms", "lag_ms"}
    # The records carry the serialized histograms: a reader can merge them exactly.
    assert SecondStats.from_json(second).hist["latency_ms"].count == 1

    timeline = agg.final_lines()
    assert timeline == [{k: v for k, v in first.items() if k not in ("final", "scheduled_in_full")}]

    rec.finished(1, "ok", 900.0, 1.9, mode="cpu", tenant="beta")
    agg.add_report("w1", rec.take_report(next_due_s=None, final=True))
    (settled,) = agg.final_lines()
    assert settled["t"] == 1 and settled["unanswered"] == 0 and settled["ok"] == 1
    assert agg.seconds_lines(0.0, 10.0)[1] == {**settled, "final": True, "scheduled_in_full": True}
    # Lines already in the file stay final even when their worker goes silent.
    agg._workers.clear()
    assert all(x["final"] for x in agg.seconds_lines(0.0, 10.0))


def test_a_second_is_scheduled_in_full_once_every_worker_has_reported_past_it():
    """Two workers share the schedule: a second can be judged once both have reported their
    arrivals of it, answered or not (before it is final); a lost worker no longer holds it."""
    agg = Aggregate(START, duration_s=10.0, target_qps=4.0)
    ahead, behind = Recorder(), Recorder()
    for sec in range(4):
        ahead.scheduled(sec)
    for sec in range(2):
        behind.scheduled(sec)
    agg.add_report("ahead", ahead.take_report(next_due_s=4.2))
    agg.add_report("behind", behind.take_report(next_due_s=2.5))
    live = agg.seconds_lines(0.0, 10.0)
    assert [x["scheduled_in_full"] for x in live] == [True, True, False, False]
    assert not any(x["final"] for x in live)  # nothing is answered yet
    agg.expect("late")  # a third share whose worker has not reported yet: it may hold any
    assert not any(x["scheduled_in_full"] for x in agg.seconds_lines(0.0, 10.0))
    agg.mark_lost("late")
    agg.mark_lost("behind")
    assert [x["scheduled_in_full"] for x in agg.seconds_lines(0.0, 10.0)] == [True] * 4
    agg.add_report("ahead", ahead.take_report(next_due_s=None))  # its schedule is over
    assert all(x["scheduled_in_full"] for x in agg.seconds_lines(0.0, 10.0))


def test_no_second_is_final_while_a_share_awaits_its_workers_first_report():
    """A worker slow to start reports its first second after the other worker has settled
    it: that second must not reach the timeline without it (the summary would count
    requests the timeline lacks)."""
    agg = Aggregate(START, duration_s=10.0, target_qps=4.0)
    early, slow = Recorder(), Recorder()
    agg.expect("early")
    agg.expect("slow")
    for recorder in (early, slow):
        recorder.scheduled(0)
        recorder.dropped(0)
    agg.add_report("early", early.take_report(next_due_s=None))
    assert agg.final_lines() == []
    assert not any(x["final"] for x in agg.seconds_lines(0.0, 10.0))
    agg.add_report("slow", slow.take_report(next_due_s=None))
    (line,) = agg.final_lines()
    assert (line["scheduled"], line["dropped"]) == (2, 2)


def test_a_lines_ts_selects_that_line_as_either_bound():
    agg, _ = _two_seconds()
    ts1 = agg.seconds_lines(0.0, 10.0)[1]["ts"]
    assert ts1 == 1_700_000_001.001  # rounded up past time zero + 1 s
    assert [x["t"] for x in agg.seconds_lines(ts1 - START, 10.0)] == [1]
    assert [x["t"] for x in agg.seconds_lines(0.0, ts1 - START)] == [0]


class _Source:
    """The LiveSource parts /seconds uses, over a plain Aggregate."""

    def __init__(self, agg: Aggregate | None) -> None:
        self.agg = agg
        self.asked: list[tuple[float, float]] = []

    def start_epoch_s(self) -> float | None:
        return None if self.agg is None else self.agg.start_epoch_s

    def now_s(self) -> float:
        return 1.75

    def seconds(self, from_s: float, to_s: float) -> list[dict[str, Any]]:
        assert self.agg is not None
        self.asked.append((from_s, to_s))
        return self.agg.seconds_lines(from_s, to_s)


def _get(app: Callable[..., Any], path: str, query: str) -> tuple[str, Any]:
    got: list[str] = []
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": query}
    body = b"".join(app(environ, lambda status, headers: got.append(status)))
    return got[0], json.loads(body)


def test_seconds_route_answers_the_records_with_time_zero_and_now():
    source = _Source(_two_seconds()[0])
    app = make_app(source)  # type: ignore[arg-type]
    status, body = _get(app, "/seconds", f"since_ts={START}")
    assert status == "200 OK"
    assert body["start_ts"] == START and body["now_s"] == 1.75
    assert [x["t"] for x in body["seconds"]] == [0, 1]
    assert source.asked[-1] == (0.0, 1.75)  # until_ts defaults to now
    status, body = _get(app, "/seconds", f"since_ts={START + 1}&until_ts={START + 2}")
    assert [x["t"] for x in body["seconds"]] == [1]
    status, body = _get(app, "/seconds", "")
    assert status == "400 Bad Request" and "since_ts" in body["error"]
    status, body = _get(app, "/seconds", "since_ts=soon")
    assert status == "400 Bad Request"


def test_seconds_route_before_the_start_is_a_conflict():
    app = make_app(_Source(None))  # type: ignore[arg-type]
    status, _ = _get(app, "/seconds", "since_ts=0")
    assert status == "409 Conflict"
