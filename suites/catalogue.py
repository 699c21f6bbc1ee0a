"""What the suites share: one case per (experiment, variant) of a folder of experiments, and
the verdict each must reach: pass on the default target, FAIL (exit 1, deviated) on each of its
known-bad variants (`negative_controls` in its llmchaos extension). A probe that cannot fail
proves nothing.

A broken experiment file is one failing case that says what is wrong, not a collection error
for the whole suite.

The cases' runs follow each other with no gap (SuiteRuns): once a run has stopped its load and
its stack, the next case's run starts (its chaos process and its stack) while the first
finishes its report and exits; the next run's load starts seconds after that. Runs whose
shares of the machine fit in it together (`machine_share`: a third or a half for most
experiments under CI, conftest.CI_EXPERIMENT_ENV) run side by side.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import allure
import pytest

from conftest import ExperimentRunner, ci_run_env, report_outcome
from llmchaos.errors import InvalidInput
from llmchaos.runner import (
    ExperimentOutcome,
    StartedExperiment,
    failure_message,
    start_experiment,
)
from llmchaos.settings import RunSettings
from llmchaos.signals import held
from llmchaos.targets import DEFAULT_VARIANT, TargetSettings, target_kind
from llmchaos.targets.embedded import EmbeddedSettings
from llmchaos.validation import ExperimentMeta, experiment_meta, validate_experiment_file

__all__ = [
    "Case",
    "SuiteRuns",
    "calibrate_target",
    "cases",
    "check_case",
    "target_rate",
    "whole_machine_first",
]


@dataclass(frozen=True)
class Case:
    """One run of a suite: an experiment against one variant, and what must come of it."""

    path: Path
    variant: str
    must_pass: bool
    meta: ExperimentMeta | None
    """None when the file could not be read: the test then reports why."""

    @property
    def id(self) -> str:
        kind = "default" if self.must_pass else "negative"
        return f"{self.path.stem}[{kind}:{self.variant}]"

    def __repr__(self) -> str:  # what Allure shows as the test's parameter
        return self.id


def cases(folder: Path) -> list[Case]:
    """Every experiment in `folder` (not below it) on the default variant, then on each of
    its negative controls."""
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            meta = experiment_meta(json.loads(path.read_text()))
        except (OSError, ValueError, InvalidInput, AttributeError, TypeError):
            found.append(Case(path, DEFAULT_VARIANT, True, None))
            continue
        found.append(Case(path, DEFAULT_VARIANT, True, meta))
        found += [Case(path, variant, False, meta) for variant in meta.negative_controls]
    return found


def whole_machine_first(found: list[Case]) -> list[Case]:
    """`found` with the cases whose runs take the whole machine first (in their order), then
    those that share it (conftest.CI_EXPERIMENT_ENV): SuiteRuns then waits for runs to stop
    before one that takes the machine once, not once per such case among the others."""
    return sorted(found, key=lambda case: _machine_share(ci_run_env(case.path.stem)) < 1)


@dataclass(frozen=True)
class _PlannedRun:
    """One case's `chaos run`: what start_experiment is given."""

    experiment: Path
    variant: str
    runs_root: Path
    env: tuple[tuple[str, str], ...]
    machine_share: float = field(default=1.0, compare=False)
    """The share of this machine's rate it takes (_machine_share)."""

    def start(self) -> StartedExperiment:
        return start_experiment(
            self.experiment,
            variant=self.variant,
            runs_root=self.runs_root,
            extra_env=dict(self.env),
        )


class SuiteRuns:
    """The suite's chaos runs, each in `suite_dir`/<test name>, with the CI phases when CI is
    set (conftest.ci_run_env). With `ahead`, the runs of the tests after the current one are
    started before those tests come, in their order, while each one's machine share
    (_machine_share) fits beside those of the runs that have not stopped their load and their
    target yet (StartedExperiment.target_stopped): two at half the machine each run side by
    side, one that takes the whole machine starts once the runs before it have stopped their
    targets (they only finish their reports then). Only tests that are cases are looked at
    (the look-ahead stops at any other test), and a case that check_case does not run
    (invalid, or its variant not on the target) starts nothing. A test whose run was started
    ahead waits for it instead of starting its own; a session that ends first stops the runs
    started ahead for tests that did not come (close())."""

    def __init__(self, suite_dir: Path, ahead: bool) -> None:
        self.suite_dir = suite_dir
        self.ahead = ahead
        self._started: dict[str, tuple[_PlannedRun, StartedExperiment]] = {}
        """Runs started before their test came, by the test's node id."""
        self._plans: dict[str, _PlannedRun | None] = {}
        """Each following case's run (None: check_case starts none), planned once."""

    def run(
        self, item: pytest.Item, experiment: Path, variant: str, env: Mapping[str, str]
    ) -> ExperimentOutcome:
        """`chaos run` `experiment` on `variant` for the test `item`, or take the run started
        for it ahead; wait for its outcome."""
        planned = self._plan(item, experiment, variant, env)
        started = self._take(item.nodeid, planned) or planned.start()
        if not self.ahead:
            return started.wait()
        return started.wait(
            while_waiting=functools.partial(self._start_what_fits, item, (planned, started))
        )

    def close(self) -> None:
        """Stop the runs started ahead for tests that did not come (the session ended): all
        of them, whatever one's stop raises, and no second Ctrl-C cuts this short."""
        with held("stopping the runs started ahead"), contextlib.ExitStack() as stops:
            for nodeid in list(self._started):
                stops.callback(self._take, nodeid, None)

    def _plan(
        self, item: pytest.Item, experiment: Path, variant: str, env: Mapping[str, str]
    ) -> _PlannedRun:
        folder = "".join(c if c.isalnum() or c in "-_." else "_" for c in item.name)
        run_env = {**ci_run_env(experiment.stem), **env}
        return _PlannedRun(
            experiment,
            variant,
            self.suite_dir / folder,
            tuple(sorted(run_env.items())),
            _machine_share(run_env),
        )

    def _start_what_fits(
        self, item: pytest.Item, current: tuple[_PlannedRun, StartedExperiment]
    ) -> None:
        """Start the runs of the tests after `item` that fit (the class docstring). An error
        here stops looking ahead for the session: each test then starts its own run, and the
        error shows in the test it belongs to instead of failing the current one."""
        try:
            self._start_following(item, current)
        except Exception as exc:
            self.ahead = False
            warnings.warn(f"the suite stopped starting runs ahead: {exc}", stacklevel=1)

    def _start_following(
        self, item: pytest.Item, current: tuple[_PlannedRun, StartedExperiment]
    ) -> None:
        holding = [current, *self._started.values()]
        in_use = sum(p.machine_share for p, run in holding if not run.target_stopped())
        items = item.session.items
        for following in items[items.index(item) + 1 :]:
            case = _case(following)
            if case is None:
                return  # not a case: what it loads is not known
            if following.nodeid not in self._plans:
                self._plans[following.nodeid] = self._case_run(following, case)
            planned = self._plans[following.nodeid]
            if planned is None or following.nodeid in self._started:
                continue  # a case that starts no run, or started already
            if in_use + planned.machine_share > 1 + _SHARE_SLACK:
                return
            with held("starting a run ahead"):  # a Ctrl-C must not leave it unrecorded
                self._started[following.nodeid] = (planned, planned.start())
            in_use += planned.machine_share

    def _case_run(self, item: pytest.Item, case: Case) -> _PlannedRun | None:
        """The run of `item`, the test of `case`, when check_case runs one."""
        if _no_run(case) is not None:
            return None
        return self._plan(item, case.path, case.variant, {})

    def _take(self, nodeid: str, planned: _PlannedRun | None) -> StartedExperiment | None:
        """The run started ahead for the test `nodeid` when it is `planned`; one that is not
        is stopped and its folder removed (its test never asked for it)."""
        started = self._started.pop(nodeid, None)
        if started is None:
            return None
        if started[0] == planned:
            return started[1]
        started[1].stop()
        shutil.rmtree(started[0].runs_root, ignore_errors=True)
        return None


def _case(item: pytest.Item) -> Case | None:
    callspec = getattr(item, "callspec", None)
    case = callspec.params.get("case") if callspec is not None else None
    return case if isinstance(case, Case) else None


def _target_settings(env: Mapping[str, str] | None = None) -> tuple[str, TargetSettings]:
    """The suite's target (LLMCHAOS_TARGET) and its settings from the environment (with
    `env` over it)."""
    settings = RunSettings.from_configuration({}, {**os.environ, **(env or {})})
    assert settings.target_settings is not None
    return settings.target, settings.target_settings


_SHARE_SLACK = 1e-9
"""Shares that add up to 1 in floating point (0.1 + 0.2 + 0.7) still fit."""


def _machine_share(run_env: Mapping[str, str]) -> float:
    """The share of this machine's rate a run with `run_env` over the environment takes
    (EmbeddedSettings.machine_share); the whole machine on any other target (a cluster's or
    hosts' services are not split)."""
    _target, settings = _target_settings(run_env)
    return settings.machine_share if isinstance(settings, EmbeddedSettings) else 1.0


def calibrate_target() -> None:
    """Measure this machine's rate for the target before the first case (the root conftest's
    pytest_collection_finish), when it is not cached and no cap is given (the embedded
    stack; nothing for a cluster), so no case's time includes it."""
    target, settings = _target_settings()
    target_kind(target).prepare(settings, progress=print)


def target_rate() -> str:
    """The rate the cases run at and where it comes from, for the session's last lines (a CI
    log's tail shows it: how fast its machine was)."""
    target, settings = _target_settings()
    kind = target_kind(target)
    qps = kind.max_qps(settings)
    if qps is None:
        return f"the {target} target: each experiment's own qps"
    return (
        f"the {target} target at {qps:g} QPS ({kind.max_qps_source(settings)}), or an "
        "experiment's own rate cap where it sets one"
    )


def _no_run(case: Case) -> tuple[bool, str] | None:
    """Why check_case starts no chaos run for `case`: (True, why) fails the test, (False,
    why) skips it; None: it runs one."""
    problems = validate_experiment_file(case.path)
    if problems or case.meta is None:
        return True, (
            f"framework error: {case.path.name} is not a valid experiment:\n  "
            + "\n  ".join(problems or ["unreadable llmchaos extension"])
        )
    target, settings = _target_settings()
    # a cluster has only its default variant
    if not case.must_pass and case.variant not in target_kind(target).variants(settings):
        return False, f"the {target} target has no known-bad variant {case.variant!r}"
    return None


def check_case(case: Case, run_experiment: ExperimentRunner) -> None:
    """Run `case` through `chaos run` and fail the test unless it reached its verdict."""
    expectation = "must pass" if case.must_pass else "known-bad: must fail"
    allure.dynamic.title(f"{case.path.stem} on {case.variant} ({expectation})")
    allure.dynamic.story(case.path.stem)
    no_run = _no_run(case)
    if no_run is not None:
        fails, why = no_run
        if not fails:
            pytest.skip(why)
        allure.dynamic.feature("invalid experiment")
        pytest.fail(why, pytrace=False)
    assert case.meta is not None
    allure.dynamic.feature(case.meta.fault_type)
    allure.dynamic.severity(case.meta.severity)
    allure.dynamic.tag("negative-control" if not case.must_pass else "default")
    outcome = run_experiment(case.path, case.variant, {})
    report_outcome(outcome)
    result = outcome.result
    if case.must_pass:
        passed = (
            outcome.exit_code == 0
            and result is not None
            and result.verdict == "pass"
            and outcome.journal is not None
            and outcome.journal.get("status") == "completed"
            and not outcome.journal.get("deviated")
            and result.steady_state_before_met is True
            and (result.recovery_time_s or 0.0) <= result.sla_s
        )
        if not passed:
            pytest.fail(failure_message(outcome), pytrace=False)
        return
    deviated = (
        outcome.exit_code == 1
        and outcome.journal is not None
        and outcome.journal.get("deviated") is True
        and result is not None
        and result.verdict == "fail"
    )
    if not deviated:
        if result is not None and result.verdict == "pass":
            pytest.fail(
                f"negative control passed: {case.path.stem} did not fail against the known-bad "
                f"variant {case.variant}, so its probes cannot tell a broken target from a good "
                f"one; run folder {outcome.run_dir}",
                pytrace=False,
            )
        pytest.fail(
            f"{failure_message(outcome)}\n(expected: exit 1 and deviated against "
            f"{case.variant}; got exit {outcome.exit_code}, deviated "
            f"{(outcome.journal or {}).get('deviated')})",
            pytrace=False,
        )
