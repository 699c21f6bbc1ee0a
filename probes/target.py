"""Target-side probes: the engines' queues, who serves, which workers are ready."""

from __future__ import annotations

from llmchaos import measure
from llmchaos.run import current_run

__all__ = [
    "healthy_workers",
    "kv_cache_usage",
    "queue_depth",
    "served_in_mode_since_fault",
    "serving_mode_share",
    "worker_share_after_fault",
]


def queue_depth() -> float:
    """Requests waiting in the engines now: sum of vllm:num_requests_waiting."""
    return measure.queue_depth(current_run())


def kv_cache_usage() -> float:
    """The fullest KV cache of the target's engines now (0..1: vllm:kv_cache_usage_perc, or
    the engine kind's own name on the hosts target)."""
    return measure.kv_cache_usage(current_run())


def serving_mode_share(mode: str = "cpu", window_s: float = 0.0, since_fault: bool = True) -> float:
    """Share of answers served in `mode` (gpu or cpu), since the last fault by default: did
    the service degrade to CPU instead of failing?"""
    return measure.serving_mode_share(current_run(), mode, window_s, since_fault)


def served_in_mode_since_fault(mode: str = "cpu", min_share: float = 0.01) -> bool:
    """True when at least `min_share` of the answers since the last fault were served in
    `mode`: the service degraded (to CPU) instead of failing. True before any fault, so it
    can sit in the steady-state hypothesis with the tolerance `true`."""
    return measure.served_in_mode_since_fault(current_run(), mode, min_share)


def healthy_workers(mode: str = "") -> int:
    """Workers answering ready now, of `mode` (gpu, cpu; empty = any)."""
    return measure.healthy_workers(current_run(), mode)


def worker_share_after_fault(worker: str, window_s: float = 0.0) -> float:
    """Share of the requests the GPU workers' engines took over the next `window_s` seconds
    that `worker` took (finished plus in the engine, from vLLM's metrics): did routing shift
    load away from a slow worker? 0 before any fault, so it can sit in the steady-state
    hypothesis."""
    return measure.worker_share_after_fault(current_run(), worker, window_s)
