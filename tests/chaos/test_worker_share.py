"""worker_share_after_fault: the share of the GPU requests a worker took, plain and as a
multiple of its fair share (1/N), from two readings of the engines' counters."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from llmchaos import measure
from llmchaos.errors import InvalidInput
from llmchaos.targets import TargetInfo, WorkerRef

GPUS = tuple(WorkerRef(f"gpu-{i}", "gpu", f"node-{i}") for i in range(8))
CPU = WorkerRef("cpu-0", "cpu", "node-cpu")


class _Target:
    def __init__(self, readings: list[dict[str, float] | None]) -> None:
        self._readings: Iterator[dict[str, float] | None] = iter(readings)

    def info(self) -> TargetInfo:
        return TargetInfo(
            nodes=tuple(w.node for w in (*GPUS, CPU)),
            workers=(*GPUS, CPU),
            gateways=("gateway-primary",),
            partitions_supported=False,
        )

    def requests_taken(self) -> dict[str, float] | None:
        return next(self._readings)


def _run(readings: list[dict[str, float] | None], fault_ts: float | None = 1.0) -> Any:
    return SimpleNamespace(
        target=_Target(readings),
        last_fault_ts=lambda: fault_ts,
        settings=SimpleNamespace(window_s=5.0, target="fake"),
    )


def _taken(per_worker: float, gpu_0: float) -> dict[str, float]:
    return {w.name: gpu_0 if w.name == "gpu-0" else per_worker for w in GPUS} | {"cpu-0": 500}


@pytest.mark.parametrize(
    ("gpu_0_took", "share", "of_fair_share"),
    [(100, 0.125, 1.0), (0, 0.0, 0.0), (20, 0.0278, 0.2222)],
)
def test_a_workers_share_plain_and_of_its_fair_share(
    gpu_0_took: float, share: float, of_fair_share: float
) -> None:
    """8 GPU workers, 7 of them take 100 requests in the window: gpu-0's share, and the same
    against 1/8. The CPU worker's requests are not GPU requests."""
    before, after = _taken(1000, 1000), _taken(1100, 1000 + gpu_0_took)
    assert measure.worker_share_after_fault(_run([before, after]), "gpu-0", 0.01) == share
    got = measure.worker_share_after_fault(_run([before, after]), "gpu-0", 0.01, True)
    assert got == of_fair_share


def test_before_any_fault_the_share_is_zero_without_reading() -> None:
    assert measure.worker_share_after_fault(_run([], fault_ts=None), "gpu-0", 0.01, True) == 0.0


def test_a_target_without_engine_counters_says_so() -> None:
    with pytest.raises(InvalidInput, match="cannot read its engines' request counters"):
        measure.worker_share_after_fault(_run([None]), "gpu-0", 0.01)


def _without(reading: dict[str, float], worker: str) -> dict[str, float]:
    return {name: n for name, n in reading.items() if name != worker}


def test_a_worker_that_misses_a_read_is_measured_again() -> None:
    """A throttled gpu-0 whose counters missed the read after the window (0.5 s timeout) once
    counted 0 - before, clamped to 0: its known-bad variant passed with a share of 0 (CI,
    2026-12-07). Now that window is measured again; a peer that misses a read is left out of
    both."""
    before, after = _taken(1000, 1000), _taken(1100, 1050)
    readings = [before, _without(after, "gpu-0"), _without(before, "gpu-3"), after]
    got = measure.worker_share_after_fault(_run(readings), "gpu-0", 0.01, True)
    assert got == round(50 / (50 + 6 * 100) * 8, 4)


def test_a_worker_that_never_answers_both_reads_has_no_share() -> None:
    before = _taken(1000, 1000)
    readings = [before, _without(before, "gpu-0")] * measure._SHARE_WINDOWS
    with pytest.raises(measure.NotMeasured, match="gpu-0's engine did not answer both reads"):
        measure.worker_share_after_fault(_run(readings), "gpu-0", 0.01)
