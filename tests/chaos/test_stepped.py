"""The stepped load's probes (llmchaos.stepped) judge the steps a run measured."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from llmchaos import stepped
from llmchaos.errors import InvalidInput
from llmchaos.load.capacity import CapacityResult, StepResult
from llmchaos.settings import RunSettings


def _run(steps: list[StepResult] | None) -> Any:
    """What the probes read of a ChaosRun: its findings and settings."""
    findings = {} if steps is None else {"stepped": CapacityResult.of_steps(steps)}
    return SimpleNamespace(findings=findings, settings=RunSettings())


def _step(qps: float, achieved: float, p99_ms: float, ok: int, **failed: int) -> StepResult:
    return StepResult(qps, achieved, p99_ms, 0.0, 0, ok=ok, failed=failed)


SHEDDING = [
    _step(20, 20, 1000, 140),
    _step(40, 40, 1100, 280),
    _step(60, 60, 1500, 420),
    _step(80, 61, 3000, 427, **{"429": 130}),
]
"""Holds its SLO up to 60 QPS, then sheds the excess with 429 (knee at 80)."""
COLLAPSING = [
    _step(20, 20, 1000, 140),
    _step(40, 40, 1100, 280),
    _step(60, 57, 8000, 400, timeout=20),
    _step(80, 80, 2000, 560),
]
"""Times out in one step and then catches up: no knee by the rule (achieved QPS grows)."""


def test_before_the_stepped_load_every_probe_is_0() -> None:
    run = _run(None)
    assert stepped.sustainable_qps_shortfall(run, 40) == 0.0
    assert stepped.stepped_p99_ms(run, 40) == 0.0
    assert stepped.stepped_error_rate(run, 40) == 0.0
    assert stepped.stepped_unshed_failure_rate(run) == 0.0


def test_a_service_that_sheds_passes_every_probe() -> None:
    run = _run(SHEDDING)
    assert stepped.sustainable_qps_shortfall(run, 40) == 0.0
    assert stepped.sustainable_qps_shortfall(run, 70) == 10.0  # 60 before the knee
    assert stepped.stepped_p99_ms(run, 40) == 1100
    assert stepped.stepped_p99_ms(run, 80) == 3000
    assert stepped.stepped_error_rate(run, 60) == 0.0
    assert stepped.stepped_unshed_failure_rate(run) == 0.0  # a 429 is shed, not failed


def test_timeouts_count_even_when_the_steps_show_no_knee() -> None:
    result = CapacityResult.of_steps(COLLAPSING)
    assert result.knee_index is None
    assert stepped.stepped_unshed_failure_rate(_run(COLLAPSING)) == pytest.approx(
        20 / 420, abs=1e-5
    )


def test_the_profile_takes_numbers_given_as_strings_and_refuses_bad_ones() -> None:
    profile = stepped.SteppedProfile("20", "20", "120", "10")  # type: ignore[arg-type]
    assert (profile.start_qps, profile.max_qps, profile.step_s) == (20.0, 120.0, 10.0)
    with pytest.raises(InvalidInput, match="step_s"):
        stepped.SteppedProfile(20, 20, 120, 1)
    with pytest.raises(InvalidInput, match="max_qps"):
        stepped.SteppedProfile(50, 20, 40, 10)
