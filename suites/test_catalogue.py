"""The experiment catalogue as a resilience suite: every experiment in experiments/ must pass
on the default stack, and FAIL on each of its known-bad variants (suites/catalogue.py).

    pytest suites/ -m resilience            # Allure results in reports/allure-results/

One test per (experiment, variant). The soak (experiments/soak/) is a suite of its own
(suites/test_soak.py, `-m soak`): it runs for hours.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import REPO, ExperimentRunner
from suites.catalogue import Case, cases, check_case

pytestmark = pytest.mark.resilience

EXPERIMENTS_DIR = Path(os.environ.get("LLMCHAOS_EXPERIMENTS_DIR", REPO / "experiments"))
"""The catalogue; another folder can be given (the framework's own tests do)."""

HIGH_RATE = (
    ("LLMCHAOS_QPS", "1000"),
    ("LLMCHAOS_EMBEDDED_MAX_QPS", "1000"),
    ("LLMCHAOS_PROMPT_TOKENS", "10"),
    ("LLMCHAOS_CONTEXT_TOKENS", "0"),
    ("LLMCHAOS_OUTPUT_TOKENS", "4"),
    ("LLMCHAOS_STREAM_SHARE", "0"),
)
"""gpu_kill's and gateway_crash's files again at 1,000 QPS of short requests (10-token
prompts, 4-token answers, none streamed): what two simulated GPUs carry with one of them
killed (the default traffic's 554-token prompts would need 24), so the gateways, HAProxy and
the token cache take a thousand requests a second through the fault. The catalogue's files
are the same at any rate: each must pass on the default stack and fail on its known-bad
variant there too."""

CASES = cases(EXPERIMENTS_DIR)
HIGH_RATE_EXPERIMENTS = ("gpu_kill", "gateway_crash")
"""The files run at 1,000 QPS as well. token_cache_expiry is not one: at that rate its
naive-cache variant misses the SLO before the flush (30% errors: its revoked tokens go to
the 2-connection token table every time), so its negative control proves nothing there."""
CASES += [
    replace(case, env=HIGH_RATE, label="1000qps")
    for case in CASES
    if case.path.stem in HIGH_RATE_EXPERIMENTS
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_experiment(case: Case, run_experiment: ExperimentRunner) -> None:
    check_case(case, run_experiment)
