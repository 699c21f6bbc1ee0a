"""What the suites share: one case per (experiment, variant) of a folder of experiments, and
the verdict each must reach: pass on the default target, FAIL (exit 1, deviated) on each of its
known-bad variants (`negative_controls` in its llmchaos extension). A probe that cannot fail
proves nothing.

A broken experiment file is one failing case that says what is wrong, not a collection error
for the whole suite.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import allure
import pytest

from conftest import ExperimentRunner, report_outcome
from llmchaos.errors import InvalidInput
from llmchaos.runner import failure_message
from llmchaos.settings import RunSettings
from llmchaos.targets import DEFAULT_VARIANT, TargetSettings, target_kind
from llmchaos.validation import ExperimentMeta, experiment_meta, validate_experiment_file

__all__ = ["Case", "calibrate_target", "cases", "check_case", "target_rate"]


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


def _target_settings() -> tuple[str, TargetSettings]:
    """The suite's target (LLMCHAOS_TARGET) and its settings from the environment."""
    settings = RunSettings.from_configuration({}, os.environ)
    assert settings.target_settings is not None
    return settings.target, settings.target_settings


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


def check_case(case: Case, run_experiment: ExperimentRunner) -> None:
    """Run `case` through `chaos run` and fail the test unless it reached its verdict."""
    expectation = "must pass" if case.must_pass else "known-bad: must fail"
    allure.dynamic.title(f"{case.path.stem} on {case.variant} ({expectation})")
    allure.dynamic.story(case.path.stem)
    problems = validate_experiment_file(case.path)
    if problems or case.meta is None:
        allure.dynamic.feature("invalid experiment")
        pytest.fail(
            f"framework error: {case.path.name} is not a valid experiment:\n  "
            + "\n  ".join(problems or ["unreadable llmchaos extension"]),
            pytrace=False,
        )
    target, settings = _target_settings()
    # a cluster has only its default variant
    if not case.must_pass and case.variant not in target_kind(target).variants(settings):
        pytest.skip(f"the {target} target has no known-bad variant {case.variant!r}")
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
