"""The recovery probe: how long after the last fault the SLO held again."""

from __future__ import annotations

from llmchaos import measure
from llmchaos.run import current_run

__all__ = ["recovery_time_s"]


def recovery_time_s(timeout_s: float = 0.0) -> float:
    """Seconds from the last fault until every rolling window met the SLO for the stable
    period (DESIGN.md: recovery time). Waits for it, at most `timeout_s` after the fault
    (0: until a recovery within the SLA can no longer be shown), then fails. Before any
    fault it returns 0 at once. A tolerance of [0, SLA] makes it the recovery SLA."""
    return measure.recovery_time_s(current_run(), timeout_s)
