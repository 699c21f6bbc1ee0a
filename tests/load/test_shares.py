"""The master's replay of a lost worker's share counts exactly the arrivals that worker would
have scheduled after its last report, live controls included."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from llmchaos.load.schedule import ArrivalSchedule, BurstSpec, Profile, Stage
from llmchaos.load.shares import LostShare


def _by_second(times: list[float]) -> Counter[int]:
    return Counter(int(t) for t in times)


def _worker(profile: Profile, shares: int, index: int, seed: int, control=None) -> list[float]:
    """What a worker schedules (user.py): every arrival before the end (a constant stream's
    last one can fall on it); a control (offset, message) arrives while it sleeps until the
    first arrival after that offset, which it still sends."""
    schedule = ArrivalSchedule(profile, share=1 / shares, index=index, seed=seed)
    out: list[float] = []
    while (t := schedule.next_s()) is not None and t < profile.duration_s:
        if control is not None and t > control[0]:
            schedule.apply_control(control[1], control[0])
            control = None
        out.append(t)
    return out


@settings(max_examples=40, deadline=None)
@given(
    qps=st.floats(5.0, 500.0),
    arrival=st.sampled_from(["poisson", "constant"]),
    bursts=st.booleans(),
    shares=st.integers(1, 4),
    seed=st.integers(0, 2**31),
    skip_share=st.floats(0.0, 1.0),
    steps=st.integers(1, 7),
)
def test_replay_counts_what_the_worker_did_not_report(
    qps, arrival, bursts, shares, seed, skip_share, steps
):
    profile = Profile(
        "p", (Stage(6.0, qps, arrival),), BurstSpec(windows_per_min=20.0) if bursts else None
    )
    index = seed % shares
    planned = _worker(profile, shares, index, seed)
    skip = math.floor(len(planned) * skip_share)
    lost = LostShare(profile, shares=shares, index=index, seed=seed, skip=skip, controls=[])
    counted: Counter[int] = Counter()
    for step in range(1, steps + 1):  # in pieces, as the master's ticks go
        counted.update(lost.advance(6.0 * step / steps))
    assert counted == _by_second(planned[skip:])
    assert lost.advance(6.0) == Counter()  # the master never replays beyond the plan


def test_replay_applies_live_controls_as_the_worker_does():
    profile = Profile("c", (Stage(10.0, 40.0, "poisson"),))
    controls: list[tuple[float, dict]] = []
    lost = LostShare(profile, shares=2, index=1, seed=7, skip=30, controls=controls)
    before = lost.advance(3.0)
    controls.append((3.5, {"qps": 120.0}))  # the master logs it when it sends it
    counted = before + lost.advance(10.0)
    planned = _worker(profile, 2, 1, 7, control=(3.5, {"qps": 120.0}))
    assert counted == _by_second(planned[30:])
    assert sum(counted[s] for s in range(4, 10)) > 300  # 60/s for its share after the change
