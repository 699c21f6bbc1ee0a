"""Recovery on synthetic timelines: never before the fault, monotone in the stable period,
"not recovered" when the SLO never holds; and the worked examples of the definition. The
per-tenant P99 against the exact one of the raw samples."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmchaos.analysis import (
    SecondRecord,
    Slo,
    fault_impact,
    recovery,
    rolling_windows,
    tenant_latency,
)
from llmchaos.load.histogram import RELATIVE_ERROR, LogHistogram
from llmchaos.load.timeline import Recorder

SLO = Slo(p99_ms=1000.0, error_rate=0.01)
T0 = 1_700_000_000


def second(
    ts: int,
    *,
    latency_ms: float = 100.0,
    ok: int = 50,
    failed: int = 0,
    unanswered: int = 0,
    cpu: int = 0,
) -> SecondRecord:
    hist = LogHistogram()
    hist.add(latency_ms, ok + failed)
    return SecondRecord(
        ts=ts,
        scheduled=ok + failed + unanswered,
        ok=ok,
        failed={"5xx": failed} if failed else {},
        unanswered=unanswered,
        modes={"gpu": ok - cpu, "cpu": cpu} if ok else {},
        latency=hist,
    )


def timeline(kinds: list[str], start: int = T0) -> list[SecondRecord]:
    """g = good second, s = slow (p99 over the SLO), e = errors, 0 = nothing scheduled."""
    out = []
    for i, kind in enumerate(kinds):
        ts = start + i
        if kind == "g":
            out.append(second(ts))
        elif kind == "s":
            out.append(second(ts, latency_ms=5000.0))
        elif kind == "e":
            out.append(second(ts, ok=10, failed=40))
        elif kind == "0":
            out.append(SecondRecord(ts=ts))
    return out


def test_outage_of_seven_seconds_recovers_in_seven() -> None:
    records = timeline(["g"] * 20 + ["e"] * 7 + ["g"] * 30)
    result = recovery(records, T0 + 20.0, SLO, window_s=5, stable_for_s=10)
    assert result.recovered
    # windows ending at 20..30 hold an error second; the first good one covers 27..31
    assert result.recovery_time_s == 7.0
    assert result.detected_at_ts == T0 + 21  # end of the window ending with second 20
    assert result.recovered_at_ts == T0 + 27


def test_fault_without_effect_recovers_in_zero() -> None:
    records = timeline(["g"] * 40)
    result = recovery(records, T0 + 20.4, SLO, window_s=5, stable_for_s=10)
    assert result.recovered and result.recovery_time_s == 0.0 and result.detected_at_ts is None


def test_a_fault_still_acting_is_not_recovered_from_before_it_stops() -> None:
    # a surge from 20 to 35 whose harm shows from 32 on: the first 10 good windows (the
    # fault's first seconds) said "recovered in 0 s" about a fault still under way
    records = timeline(["g"] * 32 + ["e"] * 4 + ["g"] * 30)
    fault_ts = T0 + 20.0
    early = recovery(records, fault_ts, SLO, window_s=5, stable_for_s=10)
    assert early.recovered and early.recovery_time_s == 0.0
    held = recovery(
        records, fault_ts, SLO, window_s=5, stable_for_s=10, active_until_ts=fault_ts + 15
    )
    assert held.recovered and held.detected_at_ts == T0 + 33
    assert held.recovered_at_ts == T0 + 36 and held.recovery_time_s == 16.0
    # a surge that harmed nothing is recovered from in 0 s, once its last window is in
    calm = recovery(
        timeline(["g"] * 60), fault_ts, SLO, window_s=5, stable_for_s=10,
        active_until_ts=fault_ts + 15,
    )  # fmt: skip
    assert calm.recovered and calm.recovery_time_s == 0.0
    assert calm.judged_until_ts == T0 + 40  # the run ends with the window of 35..39
    cut = recovery(
        timeline(["g"] * 34), fault_ts, SLO, window_s=5, stable_for_s=10,
        active_until_ts=fault_ts + 15,
    )  # fmt: skip
    assert not cut.recovered and cut.earliest_recovery_s == 0.0


def test_slo_that_never_holds_again_is_not_recovered() -> None:
    records = timeline(["g"] * 20 + ["s"] * 30)
    result = recovery(records, T0 + 20.0, SLO, window_s=5, stable_for_s=10)
    assert not result.recovered and result.recovery_time_s is None
    assert result.detected_at_ts == T0 + 21


def test_too_short_a_good_stretch_is_not_recovery() -> None:
    records = timeline(["g"] * 10 + ["e"] * 3 + ["g"] * 12 + ["e"] * 3 + ["g"] * 16)
    result = recovery(records, T0 + 10.0, SLO, window_s=5, stable_for_s=10)
    # 12 good seconds give 8 good windows (< 10): recovery only after the second outage
    assert result.recovered and result.recovered_at_ts == T0 + 28
    assert result.recovery_time_s == 18.0


def test_unsettled_seconds_are_not_judged() -> None:
    records = timeline(["g"] * 10 + ["e"] * 2 + ["g"] * 5)
    records += [second(T0 + 17 + i, unanswered=3) for i in range(15)]
    result = recovery(records, T0 + 10.0, SLO, window_s=5, stable_for_s=10)
    assert not result.recovered and result.judged_until_ts == T0 + 17


def test_live_data_of_the_last_two_seconds_is_not_settled() -> None:
    records = timeline(["g"] * 10)
    windows = rolling_windows(records, SLO, 5, now_ts=T0 + 10.5)
    assert [w.settled for w in windows][-3:] == [True, False, False]


def test_live_data_is_settled_once_every_load_worker_has_reported_it() -> None:
    records = timeline(["g"] * 10)
    for record, in_full in zip(records, [True] * 9 + [False], strict=True):
        record.scheduled_in_full = in_full
    windows = rolling_windows(records, SLO, 5, now_ts=T0 + 10.1)
    # the load's word, not the clock: second 8 at once, second 9 not even 2 s later
    assert [w.settled for w in windows][-2:] == [True, False]
    later = rolling_windows(records, SLO, 5, now_ts=T0 + 13)
    assert not later[-1].settled
    # a silent second 8 (no record) is no more reported than second 9 is
    gap = rolling_windows([*records[:8], records[9]], SLO, 1, now_ts=T0 + 13)
    assert [w.settled for w in gap][-3:] == [True, False, False]


@pytest.mark.parametrize(
    ("answered", "certain"),
    [
        # 2 of 100 failed, 10 unanswered: even all ten fine, 2/100 > 1%
        ({"ok": 88, "failed": 2, "unanswered": 10}, "miss"),
        # 2 answered at 5 s of 100: even the other 98 at 0 ms, the P99 is over 1 s
        ({"ok": 2, "latency_ms": 5000.0, "unanswered": 98}, "miss"),
        # one failure of 100 is 1%, within the SLO if the rest are fine
        ({"ok": 89, "failed": 1, "unanswered": 10}, None),
        # fine so far: the unanswered may still be fine, or not
        ({"ok": 50, "unanswered": 50}, None),
        # one slow answer of 200 requests: the other 199 fast would keep the P99 at them
        ({"ok": 1, "latency_ms": 5000.0, "unanswered": 199}, None),
        # 5 of 1,000 in flight: all five failing is 0.5%, and the P99's rank is below them
        ({"ok": 995, "unanswered": 5}, "meet"),
        # 20 in flight: all failing would be 2%
        ({"ok": 980, "unanswered": 20}, None),
        # 5 in flight beside 6 failures: 1.1% if they fail too
        ({"ok": 989, "failed": 6, "unanswered": 5}, None),
    ],
)
def test_a_window_is_judged_before_it_settles_when_its_unanswered_cannot_change_it(
    answered: dict[str, Any], certain: str | None
) -> None:
    records = [*timeline(["g"] * 5), second(T0 + 5, **answered)]
    window = rolling_windows(records, SLO, 1, now_ts=T0 + 9)[-1]
    assert not window.settled
    assert (window.certain_miss, window.meets_slo) == (certain == "miss", certain == "meet")
    # a second that other workers may still add to is never judged
    late = rolling_windows(records, SLO, 1, now_ts=T0 + 7)[-1]
    assert not (late.certain_miss or late.meets_slo)


def test_a_recovery_is_confirmed_without_waiting_for_the_slowest_requests() -> None:
    outage = timeline(["g"] * 10 + ["e"] * 3)
    tail = [second(T0 + 13 + i, ok=995, unanswered=5) for i in range(12)]
    result = recovery(outage + tail, T0 + 10.0, SLO, window_s=1, stable_for_s=10, now_ts=T0 + 27)
    assert result.recovered and result.recovery_time_s == 3.0
    stalled = [second(T0 + 13 + i, ok=900, unanswered=100) for i in range(12)]
    result = recovery(outage + stalled, T0 + 10.0, SLO, window_s=1, stable_for_s=10, now_ts=T0 + 27)
    assert not result.recovered and result.judged_until_ts == T0 + 13


def test_a_certain_miss_is_judged_and_moves_the_earliest_recovery() -> None:
    outage = timeline(["g"] * 10 + ["e"] * 8)
    sure = [second(T0 + 18 + i, ok=40, failed=10, unanswered=20) for i in range(4)]
    result = recovery(outage + sure, T0 + 10.0, SLO, window_s=1, stable_for_s=10, now_ts=T0 + 30)
    assert not result.recovered and result.judged_until_ts == T0 + 22
    # seconds 10..21 all missed: a good run starts with second 22 at the soonest
    assert result.earliest_recovery_s == 12.0
    # the same seconds with no failure yet are not judged: second 18 may start a good run
    unsure = [second(T0 + 18 + i, unanswered=20) for i in range(4)]
    early = recovery(outage + unsure, T0 + 10.0, SLO, window_s=1, stable_for_s=10, now_ts=T0 + 30)
    assert early.judged_until_ts == T0 + 18 and early.earliest_recovery_s == 8.0


def test_a_window_with_nothing_answered_misses_the_slo() -> None:
    records = timeline(["g"] * 10 + ["0"] * 8 + ["g"] * 20)
    result = recovery(records, T0 + 10.0, SLO, window_s=3, stable_for_s=5)
    # windows ending at 12..17 hold only silent seconds; the one ending at 18 holds second 18
    assert result.detected_at_ts == T0 + 13
    assert result.recovered and result.recovered_at_ts == T0 + 16


def test_fault_impact_counts_the_fault_not_the_rest() -> None:
    records = [second(T0 + i, failed=1 if i in (3, 8) else 0) for i in range(10)]
    records += [second(T0 + 10 + i, ok=20, failed=30, cpu=15) for i in range(4)]
    records += [second(T0 + 14 + i, failed=1) for i in range(20)]
    impact = fault_impact(records, T0 + 10.0, SLO, window_s=3, until_ts=T0 + 14)
    assert impact.failed_requests == 4 * 30
    # requests scheduled up to `in_flight_s` before the fault may have been hit by it
    impact = fault_impact(records, T0 + 10.0, SLO, window_s=3, until_ts=T0 + 14, in_flight_s=5)
    assert impact.failed_requests == 4 * 30 + 1
    assert impact.cpu_mode_s == 4 and impact.cpu_answers == 60
    assert impact.gpu_return_s == 4.0
    assert impact.peak_error_rate == 0.6


kinds = st.lists(st.sampled_from("ggggse0"), min_size=5, max_size=60)


@settings(max_examples=300, deadline=None)
@given(
    before=st.integers(0, 20),
    after=kinds,
    offset=st.floats(0.0, 0.99),
    window_s=st.integers(1, 8),
    stable_for_s=st.integers(1, 15),
)
def test_recovery_is_never_before_the_fault(
    before: int, after: list[str], offset: float, window_s: int, stable_for_s: int
) -> None:
    records = timeline(["g"] * before + after)
    fault_ts = T0 + before + offset
    result = recovery(records, fault_ts, SLO, window_s=window_s, stable_for_s=stable_for_s)
    if result.recovered:
        assert result.recovery_time_s is not None and result.recovery_time_s >= 0
        assert result.recovered_at_ts is not None and result.recovered_at_ts >= fault_ts
        assert result.judged_until_ts is not None
        assert result.judged_until_ts >= fault_ts + stable_for_s - 1
    if result.detected_at_ts is not None:
        assert result.detected_at_ts > fault_ts


@settings(max_examples=300, deadline=None)
@given(
    before=st.integers(0, 10),
    after=kinds,
    window_s=st.integers(1, 8),
    stable_for_s=st.integers(1, 15),
    more_s=st.integers(1, 10),
)
def test_recovery_is_monotone_in_the_stable_period(
    before: int, after: list[str], window_s: int, stable_for_s: int, more_s: int
) -> None:
    records = timeline(["g"] * before + after)
    fault_ts = T0 + before + 0.5
    short = recovery(records, fault_ts, SLO, window_s=window_s, stable_for_s=stable_for_s)
    long = recovery(records, fault_ts, SLO, window_s=window_s, stable_for_s=stable_for_s + more_s)
    if long.recovered:
        assert short.recovered
        assert short.recovery_time_s is not None and long.recovery_time_s is not None
        assert long.recovery_time_s >= short.recovery_time_s


@settings(max_examples=200, deadline=None)
@given(
    before=st.integers(0, 20),
    bad=st.lists(st.sampled_from("se"), min_size=1, max_size=60),
    window_s=st.integers(1, 8),
    stable_for_s=st.integers(1, 15),
)
def test_never_recovered_when_the_slo_never_holds_after_the_fault(
    before: int, bad: list[str], window_s: int, stable_for_s: int
) -> None:
    records = timeline(["g"] * before + bad)
    # from the fault's second on every window holds a bad second
    result = recovery(records, T0 + before, SLO, window_s=window_s, stable_for_s=stable_for_s)
    assert not result.recovered and result.recovery_time_s is None


@settings(max_examples=60)
@given(
    samples=st.lists(
        st.tuples(
            st.integers(0, 5),  # second
            st.sampled_from(["tenant-0", "tenant-1", "tenant-2"]),
            st.floats(1.0, 20_000.0),
        ),
        min_size=1,
        max_size=400,
    ),
    since=st.integers(0, 5),
)
def test_per_tenant_p99_agrees_with_the_exact_nearest_rank(
    samples: list[tuple[int, str, float]], since: int
) -> None:
    """Each tenant's P99 from the load's own records (the recorder, its JSON lines, the
    analysis) against the exact nearest-rank P99 of the raw samples, within the histogram's
    relative error (0.5%)."""
    recorder = Recorder()
    for sec, tenant, latency_ms in samples:
        recorder.scheduled(sec)
        recorder.launched()
        recorder.finished(sec, "ok", latency_ms, sec + latency_ms / 1000, tenant=tenant)
    report = recorder.take_report(None, final=True)
    records = [
        SecondRecord.from_line({"ts": T0 + int(sec), **line})
        for sec, line in report["seconds"].items()
    ]
    measured = tenant_latency(records, since_ts=T0 + since)
    expected: dict[str, list[float]] = {}
    for sec, tenant, latency_ms in samples:
        if sec >= since:
            expected.setdefault(tenant, []).append(latency_ms)
    assert set(measured) == set(expected)
    for tenant, values in expected.items():
        values.sort()
        exact = values[max(1, math.ceil(0.99 * len(values))) - 1]
        assert measured[tenant]["requests"] == len(values)
        assert measured[tenant]["p99_ms"] == pytest.approx(exact, rel=RELATIVE_ERROR, abs=0.01)


request = st.tuples(  # a group of alike requests: outcome, latency, how many
    st.sampled_from(["ok"] * 9 + ["5xx"]),
    st.sampled_from([100.0] * 9 + [5000.0]),
    st.integers(1, 80),
)


@settings(max_examples=300, deadline=None)
@given(
    final=st.lists(st.lists(request, min_size=1, max_size=6), min_size=2, max_size=40),
    seen_s=st.integers(1, 40),
    unanswered_share=st.lists(st.floats(0, 1), min_size=40, max_size=40),
    window_s=st.integers(1, 6),
    stable_for_s=st.integers(1, 10),
)
def test_a_live_view_never_rules_out_the_recovery_that_comes(
    final: list[list[tuple[str, float, int]]],
    seen_s: int,
    unanswered_share: list[float],
    window_s: int,
    stable_for_s: int,
) -> None:
    """The probe stops waiting once `earliest_recovery_s` passes the SLA: that must be a lower
    bound of the recovery time the finished timeline gives, whatever the requests still
    unanswered at the live read turn out to be, and a live recovery must be the final one."""
    slo = Slo(p99_ms=1000.0, error_rate=0.05)

    def record(ts: int, groups: list[tuple[str, float, int]], answered: int) -> SecondRecord:
        """Second `ts` with its first `answered` groups answered, the rest in flight."""
        hist = LogHistogram()
        for _, latency_ms, n in groups[:answered]:
            hist.add(latency_ms, n)
        ok = sum(n for outcome, _, n in groups[:answered] if outcome == "ok")
        failed = sum(n for outcome, _, n in groups[:answered] if outcome != "ok")
        return SecondRecord(
            ts=ts,
            scheduled=sum(n for _, _, n in groups),
            ok=ok,
            failed={"5xx": failed} if failed else {},
            unanswered=sum(n for _, _, n in groups[answered:]),
            latency=hist,
        )

    done = [record(T0 + i, r, len(r)) for i, r in enumerate(final)]
    live = [
        record(T0 + i, r, len(r) - math.floor(unanswered_share[i] * len(r)))
        for i, r in enumerate(final[:seen_s])
    ]
    fault_ts = T0 + 1.5
    args = {"window_s": window_s, "stable_for_s": stable_for_s}
    now = recovery(live, fault_ts, slo, now_ts=T0 + min(seen_s, len(final)) + 2, **args)
    later = recovery(done, fault_ts, slo, **args)
    if later.recovered and now.earliest_recovery_s is not None:  # None: no window yet
        assert later.recovery_time_s is not None
        assert now.earliest_recovery_s <= later.recovery_time_s
    if now.recovered:
        assert later.recovered and later.recovery_time_s == now.recovery_time_s
