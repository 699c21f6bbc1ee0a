"""What the framework's own tests share besides the root conftest: they run at the reference
rate, never at this machine's calibrated one.

Experiments run by these tests (chaos runs in subprocesses included) send at most 50 QPS to
the embedded stack unless a test sets the cap itself: the tests check the framework's
mechanics, the resilience suite (suites/) the catalogue at the calibrated rate. A test that
builds settings from an explicit environment without a cap would calibrate this machine (a
minute of load): `calibrate` is replaced for every test by one that fails saying so, and the
machine's cached calibration is not read (tests/stack/test_calibration.py tests both)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import llmchaos.targets.embedded as embedded
from llmchaos.targets.embedded.calibration import Calibration

os.environ.setdefault("LLMCHAOS_EMBEDDED_MAX_QPS", "50")


def _no_calibration(path: Path, *_args: object, **_kwargs: object) -> Calibration:
    raise AssertionError(
        "this test would calibrate the machine: give embedded_max_qps (or "
        "LLMCHAOS_EMBEDDED_MAX_QPS in the environment it passes)"
    )


@pytest.fixture(autouse=True)
def _tests_do_not_calibrate(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(embedded, "calibrate", _no_calibration)
    monkeypatch.setattr(embedded, "cached_calibration", lambda _path: None)
    yield
