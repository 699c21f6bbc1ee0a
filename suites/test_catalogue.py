"""The experiment catalogue as a resilience suite: every experiment in experiments/ must pass
on the default stack, and FAIL on each of its known-bad variants (suites/catalogue.py).

    pytest suites/ -m resilience            # Allure results in reports/allure-results/

One test per (experiment, variant). The soak (experiments/soak/) is a suite of its own
(suites/test_soak.py, `-m soak`): it runs for hours.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import REPO, ExperimentRunner
from suites.catalogue import Case, cases, check_case, whole_machine_first

pytestmark = pytest.mark.resilience

EXPERIMENTS_DIR = Path(os.environ.get("LLMCHAOS_EXPERIMENTS_DIR", REPO / "experiments"))
"""The catalogue; another folder can be given (the framework's own tests do)."""

CASES = whole_machine_first(cases(EXPERIMENTS_DIR))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_experiment(case: Case, run_experiment: ExperimentRunner) -> None:
    check_case(case, run_experiment)
