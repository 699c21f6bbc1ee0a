"""How many pytest-xdist workers `make test` runs tests/ on when TEST_WORKERS is not given.

6, or 4 on a machine whose cached calibration (`llmchaos calibrate`) sustains under 1,000 QPS
during a GPU kill. On a box calibrated at 400 QPS (1.6x slower per core than the 1,400-QPS
ones) 6 workers starved the timing tests: each fresh-clone run failed 1 to 4 of them, a
different few each time, where 4 workers passed. A machine not calibrated yet gets 6 (the
suite calibrates it after the tests)."""

from __future__ import annotations

import os

from llmchaos.settings import RunSettings
from llmchaos.targets.embedded import EmbeddedSettings, machine_calibration

WORKERS = 6
SLOW_BOX_WORKERS = 4
SLOW_BOX_QPS = 1000.0


def workers_for_this_machine() -> int:
    settings = RunSettings.from_configuration({}, {**os.environ, "LLMCHAOS_TARGET": "embedded"})
    assert isinstance(settings.target_settings, EmbeddedSettings)
    calibration = machine_calibration(settings.target_settings)
    if calibration is not None and calibration.qps < SLOW_BOX_QPS:
        return SLOW_BOX_WORKERS
    return WORKERS


if __name__ == "__main__":
    print(workers_for_this_machine())
