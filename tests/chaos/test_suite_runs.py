"""suites.catalogue.SuiteRuns's order of runs, with `chaos run` replaced by a recorder: two
cases whose machine shares fit together run side by side, a case that takes the whole
machine starts once the run before it has stopped its target. (tests/chaos/test_gameday.py
runs the real thing.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import suites.catalogue as catalogue
from conftest import REPO
from llmchaos.runner import ExperimentOutcome
from suites.catalogue import Case, SuiteRuns, cases


class _Recorded:
    """A started run that writes what happens to it in `events`."""

    def __init__(self, planned: Any, events: list[str]) -> None:
        self.name = f"{planned.experiment.stem}/{planned.variant}"
        self.share = dict(planned.env).get("LLMCHAOS_MACHINE_SHARE", "1")
        self.events = events
        events.append(f"start {self.name} at share {self.share}")

    def wait(self, on_target_stopped: Callable[[], None] | None = None) -> ExperimentOutcome:
        self.events.append(f"wait {self.name}")
        if on_target_stopped is not None:
            self.events.append(f"target stopped {self.name}")
            on_target_stopped()
        return ExperimentOutcome(
            experiment=Path(self.name),
            variant="",
            exit_code=0,
            journal=None,
            result=None,
            run_dir=None,
            log_path=Path("chaos.log"),
            duration_s=0.0,
            timed_out=False,
        )

    def stop(self) -> None:
        self.events.append(f"stop {self.name}")


def _items(chosen: list[Case]) -> list[Any]:
    session = SimpleNamespace(items=[])
    session.items = [
        SimpleNamespace(
            session=session, name=case.id, callspec=SimpleNamespace(params={"case": case})
        )
        for case in chosen
    ]
    return session.items


def test_shares_that_fit_run_side_by_side_and_a_whole_machine_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "CI", "1"
    )  # conftest.CI_EXPERIMENT_ENV: gpu_kill at 0.5, stepped_capacity at 1
    monkeypatch.delenv("LLMCHAOS_TARGET", raising=False)
    events: list[str] = []
    monkeypatch.setattr(catalogue._PlannedRun, "start", lambda self: _Recorded(self, events))
    by_id = {case.id: case for case in cases(REPO / "experiments")}
    chosen = [
        by_id["gpu_kill[default:hardened]"],
        by_id["gpu_kill[negative:no-failover]"],
        by_id["stepped_capacity[default:hardened]"],
    ]
    runs = SuiteRuns(tmp_path, ahead=True)
    for item, case in zip(_items(chosen), chosen, strict=True):
        runs.run(item, case.path, case.variant, {})
    runs.close()
    assert events == [
        "start gpu_kill/hardened at share 0.5",
        "start gpu_kill/no-failover at share 0.5",  # at once: half and half fit
        "wait gpu_kill/hardened",
        "wait gpu_kill/no-failover",
        "target stopped gpu_kill/no-failover",
        "start stepped_capacity/hardened at share 1",  # only then: it takes the machine
        "wait stepped_capacity/hardened",
    ]


def test_on_another_target_runs_never_share_the_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster or hosts target serves each run with the same services: the share (an
    embedded setting) does not split them, so runs follow each other."""
    monkeypatch.setenv("CI", "1")
    monkeypatch.setenv("LLMCHAOS_TARGET", "k8s")
    monkeypatch.setenv("LLMCHAOS_K8S_ALLOWED_NAMESPACES", "llmchaos")
    events: list[str] = []
    monkeypatch.setattr(catalogue._PlannedRun, "start", lambda self: _Recorded(self, events))
    monkeypatch.setattr(catalogue, "_no_run", lambda _case: None)  # k8s has no known-bad variant
    by_id = {case.id: case for case in cases(REPO / "experiments")}
    chosen = [by_id["gpu_kill[default:hardened]"], by_id["gpu_kill[negative:no-failover]"]]
    runs = SuiteRuns(tmp_path, ahead=True)
    for item, case in zip(_items(chosen), chosen, strict=True):
        runs.run(item, case.path, case.variant, {})
    assert events[:3] == [
        "start gpu_kill/hardened at share 0.5",
        "wait gpu_kill/hardened",
        "target stopped gpu_kill/hardened",
    ]
