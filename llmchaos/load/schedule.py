"""Arrival schedules: when each request is due, independent of how the target answers.

A profile is a piecewise-constant total rate (stages) plus optional burst windows. Each worker
follows its share of the rate: a Poisson process thinned by `share` is again Poisson, and a
constant-rate stream is split by phase, so N workers together send the profile's rate.

Bursts (after the field model): burst windows start as a Poisson process (0.5 per minute) and
last `duration_s`; inside a window, waves arrive with Gamma(k=2, theta=100 ms) gaps, and each
wave adds Poisson(factor x base rate x gap) requests at once, so a burst's extra rate follows
the current baseline. Burst windows and wave times come from the run seed alone, so all workers
burst together; wave sizes are split by share.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["ArrivalSchedule", "BurstSpec", "Profile", "Stage"]


@dataclass(frozen=True)
class Stage:
    """A span of constant total rate."""

    duration_s: float
    qps: float
    arrival: str = "poisson"
    """"poisson" (exponential gaps) or "constant" (evenly spaced)."""


@dataclass(frozen=True)
class BurstSpec:
    """Burst windows on top of the stages (see the module docstring)."""

    windows_per_min: float = 0.5
    duration_s: float = 10.0
    gap_shape_k: float = 2.0
    gap_theta_s: float = 0.1
    factor: float = 1.0
    """Extra rate during a burst as a multiple of the base rate (1.0 doubles it)."""


@dataclass(frozen=True)
class Profile:
    """What a run sends: stages back to back, optional bursts."""

    name: str
    stages: tuple[Stage, ...]
    bursts: BurstSpec | None = None

    @property
    def duration_s(self) -> float:
        return sum(stage.duration_s for stage in self.stages)

    def qps_at(self, t_s: float) -> float:
        """Total base rate (without bursts) at offset `t_s`; 0 after the end."""
        start = 0.0
        for stage in self.stages:
            if start <= t_s < start + stage.duration_s:
                return stage.qps
            start += stage.duration_s
        return 0.0


class ArrivalSchedule:
    """Scheduled send offsets (seconds from the run start) for one worker, in order.

    `next_s()` returns the next offset or None at the end. `set_qps` and `add_burst` change the
    schedule from a given offset on (live control); arrivals already returned are kept.
    """

    def __init__(self, profile: Profile, *, share: float = 1.0, index: int = 0, seed: int = 0):
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be within (0, 1], got {share}")
        self.profile = profile
        self.share = share
        self._rng = random.Random(seed * 1_000_003 + index)
        self._stage_starts = _starts(profile.stages)
        self._t_s = 0.0
        self._stage_index = 0
        # Constant streams of different workers are interleaved by phase.
        self._need = (index * share) % 1.0 if profile.stages[0].arrival == "constant" else None
        self._pending: list[float] = []  # burst arrivals, a heap
        self._handed_out_s = 0.0
        """The last offset next_s() returned."""
        self._base_next: float | None = self._advance_base()
        if profile.bursts is not None:
            self._plan_bursts(profile.bursts, random.Random(seed), 0.0, profile.duration_s)

    def _advance_base(self) -> float | None:
        """The next base arrival, walking the cumulative intensity across stages."""
        stages = self.profile.stages
        while self._stage_index < len(stages):
            stage = stages[self._stage_index]
            if self._need is None:
                self._need = 1.0 if stage.arrival == "constant" else self._rng.expovariate(1.0)
            rate = stage.qps * self.share
            end_s = self._stage_starts[self._stage_index] + stage.duration_s
            available = rate * (end_s - self._t_s)
            if rate > 0 and available >= self._need:
                # Rounded to 1 ns so evenly spaced sends do not drift across a stage end.
                self._t_s = round(self._t_s + self._need / rate, 9)
                self._need = None
                return self._t_s
            self._need -= max(available, 0.0)
            self._t_s = end_s
            self._stage_index += 1
        return None

    def _plan_bursts(
        self, spec: BurstSpec, rng: random.Random, from_s: float, until_s: float
    ) -> None:
        t_s = from_s
        while True:
            t_s += rng.expovariate(spec.windows_per_min / 60.0)
            if t_s >= until_s:
                return
            self._plan_window(spec, rng, t_s, min(t_s + spec.duration_s, until_s))

    def _plan_window(
        self, spec: BurstSpec, rng: random.Random, start_s: float, end_s: float
    ) -> None:
        wave_s = start_s
        while True:
            gap_s = rng.gammavariate(spec.gap_shape_k, spec.gap_theta_s)
            wave_s += gap_s
            if wave_s >= end_s:
                return
            mean = spec.factor * self.profile.qps_at(wave_s) * gap_s * self.share
            for _ in range(_poisson(self._rng, mean)):
                heapq.heappush(self._pending, wave_s)

    def next_s(self) -> float | None:
        """The next scheduled offset in seconds, or None when the schedule is over."""
        base = self._base_next
        if self._pending and (base is None or self._pending[0] <= base):
            self._handed_out_s = heapq.heappop(self._pending)
            return self._handed_out_s
        if base is None:
            return None
        self._base_next = self._advance_base()
        self._handed_out_s = base
        return base

    def set_qps(self, qps: float, at_s: float) -> None:
        """From offset `at_s` to the end, send `qps` in total (this worker: its share)."""
        if qps < 0:
            raise ValueError(f"qps must be >= 0, got {qps}")
        kept: list[Stage] = []
        start = 0.0
        for stage in self.profile.stages:
            if start + stage.duration_s <= at_s:
                kept.append(stage)
            elif start < at_s:
                kept.append(replace(stage, duration_s=at_s - start))
            start += stage.duration_s
        arrival = self.profile.stages[min(self._stage_index, len(self.profile.stages) - 1)].arrival
        rest_s = max(self.profile.duration_s - at_s, 0.0)
        kept.append(Stage(duration_s=rest_s, qps=qps, arrival=arrival))
        self.profile = replace(self.profile, stages=tuple(kept))
        self._stage_starts = _starts(self.profile.stages)
        # Restart the base process at at_s; memoryless for Poisson, a phase reset for constant.
        self._t_s = max(at_s, 0.0)
        self._stage_index = len(kept) - 1
        self._need = None
        self._base_next = self._advance_base()

    def apply_control(self, control: dict[str, Any], at_s: float) -> None:
        """Apply a live control message of the master ({"qps"} and/or {"burst": {"duration_s",
        "factor", "seed"}}) at offset `at_s`, or from the last offset handed out if that is
        later: a worker holds that arrival while it sleeps until it, and its reports say every
        arrival before it is scheduled (the recovery probe judges those seconds), so none may
        come before it. The workers and the master's replay of a lost worker's share
        (shares.py) change their schedules the same way."""
        at_s = max(at_s, self._handed_out_s)
        if "qps" in control:
            self.set_qps(float(control["qps"]), at_s)
        if "burst" in control:
            b = control["burst"]
            self.add_burst(at_s, float(b["duration_s"]), float(b["factor"]), int(b["seed"]))

    def add_burst(self, at_s: float, duration_s: float, factor: float, seed: int = 0) -> None:
        """Add one burst window starting at offset `at_s` (waves seeded by `seed`)."""
        spec = replace(self.profile.bursts or BurstSpec(), duration_s=duration_s, factor=factor)
        end_s = min(at_s + duration_s, self.profile.duration_s)
        self._plan_window(spec, random.Random(seed), at_s, end_s)


def _starts(stages: tuple[Stage, ...]) -> list[float]:
    starts, t_s = [], 0.0
    for stage in stages:
        starts.append(t_s)
        t_s += stage.duration_s
    return starts


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson(mean) draw; normal approximation above 50 where the exact loop gets slow."""
    if mean <= 0:
        return 0
    if mean > 50:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p < limit:
            return k
        k += 1
