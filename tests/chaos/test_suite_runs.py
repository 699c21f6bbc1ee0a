"""suites.catalogue.SuiteRuns's order of runs, with `chaos run` replaced by a recorder: runs
start in the tests' order while their machine shares fit beside those of the runs whose
targets are still up; a case that takes the whole machine waits for every run before it.
(tests/chaos/test_gameday.py runs the real thing.)"""

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


class _Clock:
    """The recorded runs and what happened to them; a run's target stops after its number
    of ticks, one tick for each poll of the run a test waits for."""

    def __init__(self, ticks: dict[str, int]) -> None:
        self.ticks = ticks
        self.events: list[str] = []
        self.runs: list[_Recorded] = []

    def tick(self) -> None:
        for run in self.runs:
            run.ticks_left -= 1
            if run.ticks_left == 0:
                self.events.append(f"stopped {run.name}")


class _Recorded:
    """A started run whose target stops after its ticks."""

    def __init__(self, planned: Any, clock: _Clock) -> None:
        self.name = f"{planned.experiment.stem}/{planned.variant}"
        self.clock = clock
        self.ticks_left = clock.ticks[self.name]
        clock.events.append(f"start {self.name} at share {planned.machine_share:g}")
        clock.runs.append(self)

    def target_stopped(self) -> bool:
        return self.ticks_left <= 0

    def wait(self, while_waiting: Callable[[], None] | None = None) -> ExperimentOutcome:
        while True:
            if while_waiting is not None:
                while_waiting()
            if self.target_stopped():
                break
            self.clock.tick()
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
        self.clock.events.append(f"stop {self.name}")


OTHER_TEST = "another test"
"""In a list of case ids: a test that is not a case."""


def _items(chosen: list[Case | None]) -> list[Any]:
    """pytest's items for the cases `chosen` (None: a test that is not a case), as much of
    them as SuiteRuns reads."""
    session = SimpleNamespace(items=[])
    session.items = [
        SimpleNamespace(session=session, name="test_other", nodeid="tests::other")
        if case is None
        else SimpleNamespace(
            session=session,
            name=case.id,
            nodeid=f"suites/test_catalogue.py::test_experiment[{case.id}]",
            callspec=SimpleNamespace(params={"case": case}),
        )
        for case in chosen
    ]
    return session.items


@pytest.fixture(autouse=True)
def _ci_on_the_embedded_target(monkeypatch: pytest.MonkeyPatch) -> None:
    # conftest.CI_EXPERIMENT_ENV: gpu_kill at 0.33, gpu_xid_errors 0.5, stepped_capacity 1
    monkeypatch.setenv("CI", "1")
    monkeypatch.delenv("LLMCHAOS_TARGET", raising=False)


def _run_suite(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ids: list[str],
    ticks: dict[str, int],
    tests_that_come: int | None = None,
) -> list[str]:
    """Run the tests `ids` (case ids, or OTHER_TEST) in order through SuiteRuns, the session
    ending after the first `tests_that_come` of them (all by default); what the clock saw."""
    clock = _Clock(ticks)
    monkeypatch.setattr(catalogue._PlannedRun, "start", lambda self: _Recorded(self, clock))
    by_id: dict[str, Case | None] = {case.id: case for case in cases(REPO / "experiments")}
    runs = SuiteRuns(tmp_path, ahead=True)
    for item in _items([by_id.get(i) for i in ids])[:tests_that_come]:
        case = catalogue._case(item)
        if case is not None:
            runs.run(item, case.path, case.variant, {})
    runs.close()
    return clock.events


def test_runs_start_in_order_while_their_shares_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _run_suite(
        tmp_path,
        monkeypatch,
        [
            "gpu_kill[default:hardened]",
            "gpu_kill[negative:no-failover]",
            "gpu_xid_errors[default:hardened]",
            "stepped_capacity[default:hardened]",
        ],
        {
            "gpu_kill/hardened": 3,
            "gpu_kill/no-failover": 1,
            "gpu_xid_errors/hardened": 1,
            "stepped_capacity/hardened": 1,
        },
    )
    assert events == [
        "start gpu_kill/hardened at share 0.33",
        "start gpu_kill/no-failover at share 0.33",  # at once: a third and a third fit
        "stopped gpu_kill/no-failover",
        "start gpu_xid_errors/hardened at share 0.5",  # in its place, gpu_kill still going
        "stopped gpu_xid_errors/hardened",
        "stopped gpu_kill/hardened",
        "start stepped_capacity/hardened at share 1",  # only now: it takes the machine
        "stopped stepped_capacity/hardened",
    ]


def test_on_another_target_runs_never_share_the_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster or hosts target serves each run with the same services: the share (an
    embedded setting) does not split them, so runs follow each other."""
    monkeypatch.setenv("LLMCHAOS_TARGET", "k8s")
    monkeypatch.setenv("LLMCHAOS_K8S_ALLOWED_NAMESPACES", "llmchaos")
    monkeypatch.setattr(catalogue, "_no_run", lambda _case: None)  # k8s has no known-bad variant
    events = _run_suite(
        tmp_path,
        monkeypatch,
        ["gpu_kill[default:hardened]", "gpu_kill[negative:no-failover]"],
        {"gpu_kill/hardened": 2, "gpu_kill/no-failover": 2},
    )
    assert events == [
        "start gpu_kill/hardened at share 1",
        "stopped gpu_kill/hardened",
        "start gpu_kill/no-failover at share 1",
        "stopped gpu_kill/no-failover",
    ]


def test_a_session_that_ends_stops_the_runs_started_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _run_suite(
        tmp_path,
        monkeypatch,
        ["gpu_kill[default:hardened]", "gpu_kill[negative:no-failover]"],
        {"gpu_kill/hardened": 1, "gpu_kill/no-failover": 5},
        tests_that_come=1,  # pytest -x after the first
    )
    assert events == [
        "start gpu_kill/hardened at share 0.33",
        "start gpu_kill/no-failover at share 0.33",
        "stopped gpu_kill/hardened",
        "stop gpu_kill/no-failover",
    ]


def test_a_test_that_is_not_a_case_stops_the_look_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What another test between two cases loads is not known: the case after it starts
    only when it comes."""
    events = _run_suite(
        tmp_path,
        monkeypatch,
        ["gpu_kill[default:hardened]", OTHER_TEST, "gpu_kill[negative:no-failover]"],
        {"gpu_kill/hardened": 1, "gpu_kill/no-failover": 1},
    )
    assert events == [
        "start gpu_kill/hardened at share 0.33",
        "stopped gpu_kill/hardened",
        "start gpu_kill/no-failover at share 0.33",
        "stopped gpu_kill/no-failover",
    ]
