"""Load changes: the traffic is part of the chaos too."""

from __future__ import annotations

from typing import Any

from llmchaos import faults, stepped
from llmchaos.run import current_run

__all__ = ["inject_burst", "long_prompt_surge", "set_qps", "step_load"]


def set_qps(qps: float) -> float:
    """Send `qps` requests/s in total from now on (back to the previous rate at the run's
    end). Returns the previous rate."""
    return faults.set_qps(current_run(), qps)


def inject_burst(duration_s: float = 10.0, factor: float = 1.0) -> float:
    """A burst starting now: `factor` x the base rate on top of it for `duration_s` seconds.
    Returns the extra requests/s."""
    return faults.inject_burst(current_run(), duration_s, factor)


def long_prompt_surge(
    qps: float | None = None,
    duration_s: float = 15.0,
    prompt_tokens: float = 6000,
    max_tokens: float = 200,
    qps_per_gpu: float | None = None,
    stream: bool = False,
) -> dict[str, Any]:
    """A surge of long prompts from one tenant beside the load: `qps` requests a second (or
    `qps_per_gpu` per GPU worker of the target; neither: 4) of `prompt_tokens` prompt tokens
    and `max_tokens` output, for `duration_s`, streamed or not (`stream`). It fills the
    engines' KV cache (preemptions, queue growth); the load's SLO is judged as usual."""
    return faults.long_prompt_surge(
        current_run(), qps, duration_s, prompt_tokens, max_tokens, qps_per_gpu, stream
    )


def step_load(
    start_qps: float, increment_qps: float, max_qps: float, step_s: float
) -> dict[str, Any]:
    """The seed's stepped profile: `start_qps`, + `increment_qps` every `step_s`, up to
    `max_qps` (every step runs, the knee's and those past it too: they show how the service
    takes the overload). Returns per step offered and achieved QPS, P99, error rate by class
    and frame drops, the knee step and the sustainable QPS."""
    profile = stepped.SteppedProfile(start_qps, increment_qps, max_qps, step_s)
    return stepped.step_load(current_run(), profile).to_dict()
