"""The seed's stepped profile inside a chaos run: the load steps up, each step is measured, and
the capacity knee is judged (experiments/stepped_capacity.json).

`step_load` runs in the method: it sets the load's rate step by step (`faults.set_qps`, so the
ledger restores the rate) up to the peak, as the seed's plan does: the steps past the knee
show how the service takes an overload. Once the last requests have answered or timed out it
reads each step from the load's windows as `llmchaos capacity` does (llmchaos.load.capacity:
the same step figures and knee rule): those are the figures reported
(`stepped.json`, `stepped.svg` and a table in the run's notes) and judged by the probes after
the method. Before the method nothing is measured and the probes check nothing (0).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from llmchaos import faults
from llmchaos.configuration import Range
from llmchaos.errors import InvalidInput
from llmchaos.files import write_json_atomic
from llmchaos.load.capacity import (
    SETTLE_S,
    CapacityResult,
    StepResult,
    render_table,
    step_result,
    write_chart,
)
from llmchaos.load.profiles import stepped_stages
from llmchaos.load.schedule import Stage
from llmchaos.measure import UNSHED_CLASSES, window_error_rate
from llmchaos.run import ChaosRun

__all__ = [
    "STEPPED_FILE",
    "SteppedProfile",
    "step_load",
    "stepped_error_rate",
    "stepped_p99_ms",
    "stepped_unshed_failure_rate",
    "sustainable_qps_shortfall",
]

log = logging.getLogger("chaostoolkit")

STEPPED_FILE = "stepped.json"
"""The steps' figures and the knee, in the run folder (the chart beside it: stepped.svg)."""
_FINDING = "stepped"


@dataclass(frozen=True)
class SteppedProfile:
    """The seed's stepped load (1,000 QPS, +500 every 15 min, to 6,200), scaled by the
    experiment: start, +increment every step, up to the peak (the peak itself the last step)."""

    start_qps: float = 30.0
    """First step's rate."""
    increment_qps: float = 20.0
    """Added at every step."""
    max_qps: float = 110.0
    """Peak rate: the last step (reached even when not a whole increment away)."""
    step_s: float = 30.0
    """Length of one step (seed: 900 s); the time compression."""
    warmup_share: float = 0.3
    """Share of each step left out of its figures: the queues of the step before drain, or
    grow, in it. Frame drops count from the step's start."""

    def __post_init__(self) -> None:
        # numbers from `${...}` arrive as strings ("20"): kept as the floats they stand for
        for name, allowed in _RANGES.items():
            object.__setattr__(self, name, allowed.check(name, getattr(self, name)))
        if self.max_qps < self.start_qps:
            raise InvalidInput(
                f"max_qps: expected at least start_qps ({self.start_qps:g}), got {self.max_qps:g}"
            )


_RANGES = {
    "start_qps": Range(0, 1_000_000, low_open=True),
    "increment_qps": Range(0, 1_000_000),
    "max_qps": Range(0, 1_000_000, low_open=True),
    "step_s": Range(3, 86_400),  # a step must outlast the rate check of set_qps (3.5 s)
    "warmup_share": Range(0, 0.9),
}


def step_load(run: ChaosRun, profile: SteppedProfile) -> CapacityResult:
    """Step the load through `profile` up to its peak; write the steps' figures to the
    run folder and its notes, keep them for the probes, and return them."""
    stages = stepped_stages(
        profile.start_qps, profile.increment_qps, profile.max_qps, profile.step_s
    )
    started: list[float] = []
    for stage in stages:
        start_ts = time.time()
        faults.set_qps(run, stage.qps)
        started.append(start_ts)
        time.sleep(max(0.0, start_ts + profile.step_s - time.time()))
    # the figures: every step once its requests are settled (answered or timed out)
    deadline = time.time() + run.settings.request_timeout_s + SETTLE_S
    last = run.traffic.window(since_ts=started[-1], until_ts=started[-1] + profile.step_s)
    while last["in_flight"] > 0 and time.time() < deadline:
        time.sleep(0.5)
        last = run.traffic.window(since_ts=started[-1], until_ts=started[-1] + profile.step_s)
    result = CapacityResult.of_steps(_read_steps(run, profile, started, stages))
    run.findings[_FINDING] = result
    write_json_atomic(run.run_dir / STEPPED_FILE, {"profile": profile.__dict__, **result.to_dict()})
    write_chart(result, run.run_dir / "stepped.svg")
    table = render_table(result)
    run.notes.append("stepped load, per step (error rates of the answered requests):\n" + table)
    log.info("llmchaos: stepped load:\n%s", table)
    return result


def _read_steps(
    run: ChaosRun, profile: SteppedProfile, started: list[float], stages: tuple[Stage, ...]
) -> list[StepResult]:
    steps = []
    for start_ts, stage in zip(started, stages, strict=False):
        end_ts = start_ts + profile.step_s
        window = run.traffic.window(
            since_ts=start_ts + profile.warmup_share * profile.step_s, until_ts=end_ts
        )
        whole = run.traffic.window(since_ts=start_ts, until_ts=end_ts)
        steps.append(step_result(stage.qps, window, whole))
    return steps


def _stepped(run: ChaosRun) -> CapacityResult | None:
    return run.findings.get(_FINDING)


def sustainable_qps_shortfall(run: ChaosRun, min_qps: float) -> float:
    """How many QPS the sustainable rate (the achieved QPS of the step before the knee; of
    the last step without a knee) falls short of `min_qps`: 0 when it reaches it, and before
    the stepped load ran."""
    result = _stepped(run)
    if result is None:
        return 0.0
    return round(max(0.0, float(min_qps) - result.sustainable_qps), 2)


def _steps_up_to(run: ChaosRun, up_to_qps: float) -> list[StepResult]:
    result = _stepped(run)
    if result is None:
        return []
    return [s for s in result.steps if s.offered_qps <= float(up_to_qps)]


def stepped_p99_ms(run: ChaosRun, up_to_qps: float) -> float:
    """Worst P99 of the steps offered at most `up_to_qps` (0 before the stepped load)."""
    return max((s.p99_ms or 0.0 for s in _steps_up_to(run, up_to_qps)), default=0.0)


def stepped_error_rate(run: ChaosRun, up_to_qps: float) -> float:
    """Worst SLO error rate (the run's error classes, dropped sends included) of the steps
    offered at most `up_to_qps` (0 before the stepped load)."""
    steps = _steps_up_to(run, up_to_qps)
    return max((_error_rate(s, run.settings.error_classes) for s in steps), default=0.0)


def stepped_unshed_failure_rate(run: ChaosRun) -> float:
    """Worst share of failures other than 429 (5xx, timeout, connection, bad body; dropped
    sends too) of any step: an overloaded service should shed the excess fast, not let it
    time out. Every step, not only those from the knee on: a queue that collapses and
    recovers between steps has no knee by the rule, and its timeouts still count. 0 before
    the stepped load."""
    result = _stepped(run)
    if result is None:
        return 0.0
    return max((_error_rate(s, UNSHED_CLASSES) for s in result.steps), default=0.0)


def _error_rate(step: StepResult, classes: tuple[str, ...]) -> float:
    return window_error_rate(
        {"ok": step.ok, "failed": step.failed, "dropped": step.dropped}, classes
    )
