"""Schedules: arrival counts match the rate within statistical bounds; bursts and steps keep
their declared shape."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmchaos.errors import InvalidInput
from llmchaos.load.config import LoadConfig
from llmchaos.load.profiles import build_profile, stepped_stages
from llmchaos.load.schedule import ArrivalSchedule, BurstSpec, Profile, Stage


def arrivals(schedule: ArrivalSchedule) -> list[float]:
    out = []
    while (t := schedule.next_s()) is not None:
        out.append(t)
    return out


@settings(max_examples=60, deadline=None)
@given(
    qps=st.floats(1.0, 3000.0),
    duration_s=st.floats(1.0, 20.0),
    workers=st.integers(1, 4),
    seed=st.integers(0, 2**31),
)
def test_poisson_counts_match_rate(qps: float, duration_s: float, workers: int, seed: int):
    profile = Profile("poisson", (Stage(duration_s, qps, "poisson"),))
    total = []
    for index in range(workers):
        times = arrivals(ArrivalSchedule(profile, share=1 / workers, index=index, seed=seed))
        assert times == sorted(times)
        assert all(0 <= t < duration_s for t in times)
        total.extend(times)
    expected = qps * duration_s
    # Poisson count: sd = sqrt(mean); 5 sd keeps false alarms below 1e-6 per example.
    assert abs(len(total) - expected) <= 5 * math.sqrt(expected) + 2


@settings(max_examples=40, deadline=None)
@given(qps=st.floats(1.0, 2000.0), duration_s=st.floats(1.0, 10.0), workers=st.integers(1, 4))
def test_constant_workers_interleave_evenly(qps: float, duration_s: float, workers: int):
    profile = Profile("constant", (Stage(duration_s, qps, "constant"),))
    merged = sorted(
        t
        for index in range(workers)
        for t in arrivals(ArrivalSchedule(profile, share=1 / workers, index=index))
    )
    assert abs(len(merged) - qps * duration_s) <= workers
    gaps = [b - a for a, b in itertools.pairwise(merged)]
    assert max(gaps) - min(gaps) < 1e-6 * max(1.0, duration_s)
    assert gaps[0] == pytest.approx(1 / qps, rel=1e-6)


def test_stepped_profile_has_the_field_shape():
    stages = stepped_stages(1000, 500, 6200, 900)
    assert [s.qps for s in stages] == [1000 + 500 * i for i in range(11)] + [6200]
    assert {s.duration_s for s in stages} == {900}
    config = LoadConfig(
        profile="stepped", step_s=2.0, step_start_qps=100, step_increment_qps=50, step_max_qps=310
    )
    profile = build_profile(config)
    assert profile.duration_s == 12.0
    counts = Counter(int(t // 2) for t in arrivals(ArrivalSchedule(profile, seed=5)))
    for step, qps in enumerate([100, 150, 200, 250, 300, 310]):
        expected = qps * 2.0
        assert abs(counts[step] - expected) <= 5 * math.sqrt(expected), (step, counts[step])


def test_bursts_follow_poisson_windows_and_gamma_waves():
    hours = 3
    spec = BurstSpec(windows_per_min=0.5, duration_s=10.0, factor=50.0)
    profile = Profile("bursty", (Stage(hours * 3600.0, 10.0, "poisson"),), spec)
    times = arrivals(ArrivalSchedule(profile, seed=11))
    # Base arrivals are Poisson (never equal); a wave sends many requests at one instant.
    multiplicity = Counter(times)
    waves = sorted(t for t, n in multiplicity.items() if n > 1)
    windows, current = [], [waves[0]]
    for a, b in itertools.pairwise(waves):
        if b - a > 2.0:  # a Gamma(2, 0.1 s) gap is above 2 s with probability ~4e-8
            windows.append(current)
            current = [b]
        else:
            current.append(b)
    windows.append(current)
    # 0.5 windows/min over 3 h = 90; overlapping windows merge (~8%), sd ~ 9.5.
    assert 55 <= len(windows) <= 125, len(windows)
    # Gaps inside single (not overlapping, so at most 10 s long) windows.
    gaps = [b - a for w in windows if w[-1] - w[0] <= 10.0 for a, b in itertools.pairwise(w)]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.05)  # k * theta
    assert statistics.variance(gaps) == pytest.approx(0.02, rel=0.15)  # k * theta^2
    assert max(w[-1] - w[0] for w in windows) < 2 * spec.duration_s
    # Extra requests per wave follow the baseline: factor x 10 QPS x gap, 100 on average.
    extra = sum(n for n in multiplicity.values() if n > 1)
    assert extra / len(waves) == pytest.approx(100, rel=0.1)


def test_set_qps_and_burst_change_the_rest_of_the_schedule():
    profile = Profile("constant", (Stage(10.0, 100.0, "constant"),))
    schedule = ArrivalSchedule(profile)
    before = []
    while (t := schedule.next_s()) is not None and t < 5.0:
        before.append(t)
    schedule.set_qps(300.0, at_s=5.0)
    schedule.add_burst(at_s=7.0, duration_s=1.0, factor=10.0, seed=1)
    after = [t, *arrivals(schedule)] if t is not None else []
    assert len(before) == 500
    per_second = Counter(int(x) for x in after)
    assert per_second[5] == pytest.approx(300, abs=1)
    assert per_second[9] == pytest.approx(300, abs=1)
    assert per_second[7] > 300 + 1000  # 10 x 300 QPS extra inside the burst second


def test_a_control_never_schedules_before_the_arrival_already_handed_out():
    """A worker holds its next arrival while it sleeps until it, and its reports already say
    every arrival before it is scheduled: a rate change or a burst that comes meanwhile starts
    there, not at the (earlier) moment it came."""
    profile = Profile("constant", (Stage(10.0, 10.0, "constant"),))
    schedule = ArrivalSchedule(profile)
    while (held := schedule.next_s()) is not None and held < 5.0:
        pass
    assert held == pytest.approx(5.0)
    schedule.apply_control({"qps": 1000.0}, at_s=4.95)
    schedule.apply_control({"burst": {"duration_s": 1.0, "factor": 10.0, "seed": 1}}, 4.95)
    rest = arrivals(schedule)
    assert min(rest) >= held and Counter(int(x) for x in rest)[5] > 1000


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"profile": "zigzag"}, "--profile: unknown profile 'zigzag'"),
        ({"profile": "/nope/p.json"}, "--profile: cannot read /nope/p.json"),
    ],
)
def test_bad_profiles_name_the_flag(changes: dict, message: str):
    with pytest.raises(InvalidInput, match=message):
        build_profile(LoadConfig(**changes))


def test_profile_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"stages": [{"duration_s": 2, "qps": 50}, {"duration_s": 1, "qps": 0}]}')
    profile = build_profile(LoadConfig(profile=str(path)))
    assert profile.duration_s == 3.0
    assert profile.qps_at(1.5) == 50
    assert profile.qps_at(2.5) == 0
    path.write_text('{"stages": [{"duration_s": -1, "qps": 50}]}')
    with pytest.raises(InvalidInput, match=r"stages\[0\]"):
        build_profile(LoadConfig(profile=str(path)))
