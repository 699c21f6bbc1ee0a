"""Load changes: the traffic is part of the chaos too."""

from __future__ import annotations

from llmchaos import faults
from llmchaos.run import current_run

__all__ = ["inject_burst", "set_qps"]


def set_qps(qps: float) -> float:
    """Send `qps` requests/s in total from now on (back to the previous rate at the run's
    end). Returns the previous rate."""
    return faults.set_qps(current_run(), qps)


def inject_burst(duration_s: float = 10.0, factor: float = 1.0) -> float:
    """A burst starting now: `factor` x the base rate on top of it for `duration_s` seconds.
    Returns the extra requests/s."""
    return faults.inject_burst(current_run(), duration_s, factor)
