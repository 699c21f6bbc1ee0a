"""The soak suite: the experiments of experiments/soak/ (hours of stepped load, frame drops
counted over the whole run), each passing on the default stack and failing on its known-bad
variants, as the catalogue's (suites/catalogue.py).

    pytest suites/ -m soak                              # hours (the experiments' own steps)
    LLMCHAOS_SOAK_STEP_S=15 pytest suites/ -m soak      # compressed: about 2 minutes each
    llmchaos gameday --suite soak

Not part of `pytest suites -m resilience` (nor of `make test`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import REPO, ExperimentRunner
from suites.catalogue import Case, cases, check_case

pytestmark = pytest.mark.soak

SOAK_DIR = Path(os.environ.get("LLMCHAOS_SOAK_DIR", REPO / "experiments" / "soak"))
"""The soak experiments; another folder can be given."""

CASES = cases(SOAK_DIR)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_soak(case: Case, run_experiment: ExperimentRunner) -> None:
    check_case(case, run_experiment)
