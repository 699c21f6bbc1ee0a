"""Target-side probes: the engines' queues, who serves, which workers are ready, and when
the gateways degrade."""

from __future__ import annotations

from typing import Any

from llmchaos import measure
from llmchaos.run import current_run

__all__ = [
    "degradation_trigger_delay_s",
    "degraded_unshed_failure_rate",
    "healthy_workers",
    "kv_cache_usage",
    "pulse_error_rate",
    "pulse_p99_ms",
    "queue_depth",
    "registry_has_leader",
    "scale_in_s",
    "scale_out_s",
    "served_in_mode_since_fault",
    "serving_mode_share",
    "settle_at_min_replicas",
    "watch_degradation",
    "watch_scale_in",
    "watch_scale_out",
    "worker_share_after_fault",
]


def queue_depth(per_gpu: bool = False) -> float:
    """Requests waiting in the engines now: sum of vllm:num_requests_waiting; `per_gpu`:
    that sum over the GPU workers the target has (dead ones included), the average per
    replica autoscalers scale on, which means the same at any fleet size."""
    return measure.queue_depth(current_run(), per_gpu)


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


def watch_degradation(
    queue_depth_threshold: float = 500, timeout_s: float = 30.0, degraded_for_s: float = 10.0
) -> dict[str, Any]:
    """In the method, right after the load goes up: watch the engines' queue pass
    `queue_depth_threshold` and the gateways' service_degraded_total jump (every 0.1 s, up
    to `timeout_s`), then `degraded_for_s` of the overload in degraded mode. Returns the
    figures; the hypothesis judges them with `degradation_trigger_delay_s` and
    `degraded_unshed_failure_rate`."""
    return measure.watch_degradation(
        current_run(), queue_depth_threshold, timeout_s, degraded_for_s
    )


def degradation_trigger_delay_s() -> float:
    """Seconds between the engines' queue passing the threshold and the gateways' counter
    jump (0 before the method); fails when either never happened."""
    return measure.degradation_trigger_delay_s(current_run())


def degraded_unshed_failure_rate() -> float:
    """Share of the requests of the degraded overload that failed other than by a 429
    (timeouts, 5xx, broken answers); 0 before the method, fails when it never degraded."""
    return measure.degraded_unshed_failure_rate(current_run())


def settle_at_min_replicas(timeout_s: float = 60.0) -> float:
    """In the method, before a pulse: wait (up to `timeout_s`) until the GPU pool is at its
    minimum with every replica ready; the seconds waited."""
    return measure.settle_at_min_replicas(current_run(), timeout_s)


def watch_scale_out(timeout_s: float = 60.0) -> dict[str, Any]:
    """In the method, right after the pulse starts: the GPU pool's replicas every 0.5 s until
    the autoscaler asked for more and they are ready (or `timeout_s`)."""
    return measure.watch_scale_out(current_run(), timeout_s)


def watch_scale_in(timeout_s: float = 120.0) -> dict[str, Any]:
    """In the method, right after the pulse ends: the replicas until the pool is back at its
    minimum (or `timeout_s`)."""
    return measure.watch_scale_in(current_run(), timeout_s)


def scale_out_s() -> float:
    """Seconds from the pulse's start until the new replicas were ready (0 before the
    method); fails when the pool never scaled out."""
    return measure.scale_out_s(current_run())


def scale_in_s() -> float:
    """Seconds from the pulse's end until the pool was back at its minimum (0 before the
    method); fails when it stayed larger."""
    return measure.scale_in_s(current_run())


def pulse_p99_ms() -> float:
    """P99 latency of the pulse's requests once the pool had scaled out (0 before)."""
    return measure.pulse_p99_ms(current_run())


def pulse_error_rate() -> float:
    """SLO error rate of the pulse's requests once the pool had scaled out (0 before)."""
    return measure.pulse_error_rate(current_run())


def registry_has_leader() -> bool:
    """Whether the service registry's members know a leader now (False during an election or
    without a quorum)."""
    return measure.registry_has_leader(current_run())


def worker_share_after_fault(
    worker: str, window_s: float = 0.0, of_fair_share: bool = False
) -> float:
    """Share of the requests the GPU workers' engines took over the next `window_s` seconds
    that `worker` took (finished plus in the engine, from vLLM's metrics): did routing shift
    load away from a slow or failing worker? `of_fair_share`: as a multiple of 1/N, N the
    target's GPU workers (1: as much as any), the same at any fleet size. 0 before any fault,
    so it can sit in the steady-state hypothesis. Fails when `worker`'s counters did not
    answer both reads of a window in 3 windows (its share is unknown)."""
    return measure.worker_share_after_fault(current_run(), worker, window_s, of_fair_share)
