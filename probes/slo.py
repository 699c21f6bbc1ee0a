"""Client-side SLO probes, read from the open-loop load's live windows.

Latency is measured from each request's scheduled send time, so an outage shows in P99 even
when the service stops answering. `window_s=0` uses the run's `window_s` setting;
`since_fault=true` measures from the last fault until now.
"""

from __future__ import annotations

from llmchaos import measure, stepped
from llmchaos.run import current_run

__all__ = [
    "achieved_qps",
    "error_rate",
    "frame_drops",
    "goodput_qps",
    "itl_p99_ms",
    "p99_latency_ms",
    "stepped_error_rate",
    "stepped_p99_ms",
    "stepped_unshed_failure_rate",
    "sustainable_qps_shortfall",
    "tpot_p99_ms",
    "ttft_p99_ms",
    "worst_p99_ms_since_fault",
]


def p99_latency_ms(window_s: float = 0.0, since_fault: bool = False) -> float:
    """P99 end-to-end latency in ms over the window (unanswered requests at their age)."""
    return measure.p99_latency_ms(current_run(), window_s, since_fault)


def ttft_p99_ms(window_s: float = 0.0, since_fault: bool = False) -> float:
    """P99 time to first token in ms of the streaming requests over the window (to the first
    chunk with non-empty content)."""
    return measure.ttft_p99_ms(current_run(), window_s, since_fault)


def itl_p99_ms(window_s: float = 0.0, since_fault: bool = False) -> float:
    """P99 inter-token latency in ms (gaps between content chunks) over the window."""
    return measure.itl_p99_ms(current_run(), window_s, since_fault)


def tpot_p99_ms(window_s: float = 0.0, since_fault: bool = False) -> float:
    """P99 time per output token in ms, (e2e - TTFT) / (tokens - 1), over the window."""
    return measure.tpot_p99_ms(current_run(), window_s, since_fault)


def goodput_qps(window_s: float = 0.0, since_fault: bool = False) -> float:
    """Requests/s over the window that met every SLO of the run (TTFT, TPOT, end to end)."""
    return measure.goodput_qps(current_run(), window_s, since_fault)


def error_rate(
    window_s: float = 0.0,
    since_fault: bool = False,
    classes: list[str] | None = None,
    whole_run: bool = False,
) -> float:
    """Failed share over the window (or the whole run so far), counting `classes` (default:
    the run's SLO classes: 5xx, 429, timeout, connection, bad_body) and dropped sends."""
    return measure.error_rate(current_run(), window_s, since_fault, classes, whole_run)


def frame_drops(window_s: float = 0.0, since_fault: bool = True, whole_run: bool = False) -> int:
    """Gaps of 3 s or more without a successful answer: since the last fault by default, or
    over the whole run so far (a soak's count)."""
    return measure.frame_drops(current_run(), window_s, since_fault, whole_run)


def achieved_qps(window_s: float = 0.0) -> float:
    """Answered requests per second over the window."""
    return measure.achieved_qps(current_run(), window_s)


def worst_p99_ms_since_fault() -> float:
    """Highest P99 in ms of any rolling window since the last fault."""
    return measure.worst_p99_ms_since_fault(current_run())


def sustainable_qps_shortfall(min_qps: float) -> float:
    """QPS by which the stepped load's sustainable rate (before its capacity knee) falls
    short of `min_qps`; 0 when it reaches it, and before `actions.load.step_load` ran."""
    return stepped.sustainable_qps_shortfall(current_run(), min_qps)


def stepped_p99_ms(up_to_qps: float) -> float:
    """Worst P99 in ms of the stepped load's steps offered at most `up_to_qps`."""
    return stepped.stepped_p99_ms(current_run(), up_to_qps)


def stepped_error_rate(up_to_qps: float) -> float:
    """Worst SLO error rate of the stepped load's steps offered at most `up_to_qps`."""
    return stepped.stepped_error_rate(current_run(), up_to_qps)


def stepped_unshed_failure_rate() -> float:
    """Worst share of failures other than 429 of any step of the stepped load (an overload
    should be shed, not time out); 0 before `actions.load.step_load` ran."""
    return stepped.stepped_unshed_failure_rate(current_run())
