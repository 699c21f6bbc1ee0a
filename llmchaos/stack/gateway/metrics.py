"""Prometheus metrics of one gateway.

Counters and histograms are updated on the request path; the gauges that describe the worker
pool (outstanding requests, estimated queue, healthy workers) are computed only when /metrics
is scraped, so the hot path never touches them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmchaos.stack.gateway.routing import WorkerPool

__all__ = ["CONTENT_TYPE", "GatewayMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, float("inf"))
_POOL_WAIT_BUCKETS_S = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, float("inf"))


class _PoolCollector(Collector):
    """Gauges read from the worker pool at scrape time."""

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool

    def collect(self) -> Iterable[Metric]:
        outstanding = GaugeMetricFamily(
            "llmchaos_gateway_upstream_outstanding",
            "Requests sent to a worker and not finished yet",
            labels=["worker", "mode"],
        )
        capacity = GaugeMetricFamily(
            "llmchaos_gateway_upstream_max_num_seqs",
            "Running-batch size a worker reported on /healthz",
            labels=["worker", "mode"],
        )
        for worker in self._pool.workers:
            outstanding.add_metric([worker.name, worker.mode], worker.outstanding)
            capacity.add_metric([worker.name, worker.mode], worker.max_num_seqs)
        healthy = GaugeMetricFamily(
            "llmchaos_gateway_healthy_workers",
            "Workers that pass health checks and are not ejected",
            labels=["mode"],
        )
        for mode, count in self._pool.healthy_counts().items():
            healthy.add_metric([mode], count)
        queue = GaugeMetricFamily(
            "llmchaos_gateway_estimated_queue",
            "Sum over workers of requests beyond their running batch (admission control input)",
            value=self._pool.estimated_queue(),
        )
        return [outstanding, capacity, healthy, queue]


class GatewayMetrics:
    """All metrics of one gateway, in a registry of its own (several gateways per process in
    tests must not collide)."""

    def __init__(self, pool: WorkerPool) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self._requests = Counter(
            "llmchaos_gateway_requests",
            "Chat-completion responses by serving mode (none: no worker served) and status",
            ["mode", "code"],
            registry=reg,
        )
        self._latency = Histogram(
            "llmchaos_gateway_request_duration_seconds",
            "Chat-completion time in the gateway, until the last byte, by serving mode",
            ["mode"],
            buckets=_LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.token_db_lookups = Counter(
            "llmchaos_gateway_token_db_lookups", "SQLite token lookups", registry=reg
        )
        self.token_db_pool_wait = Histogram(
            "llmchaos_gateway_token_db_pool_wait_seconds",
            "Time a token lookup waited for a SQLite connection",
            buckets=_POOL_WAIT_BUCKETS_S,
            registry=reg,
        )
        self.token_db_errors = Counter(
            "llmchaos_gateway_token_db_errors", "SQLite lookups that failed", registry=reg
        )
        self.cache_hits = Counter(
            "llmchaos_gateway_token_cache_hits", "Redis hits for a valid token", registry=reg
        )
        self.cache_negative_hits = Counter(
            "llmchaos_gateway_token_cache_negative_hits",
            "Redis hits for a token cached as unknown or revoked",
            registry=reg,
        )
        self.cache_misses = Counter(
            "llmchaos_gateway_token_cache_misses", "Redis misses", registry=reg
        )
        self.cache_coalesced = Counter(
            "llmchaos_gateway_token_cache_coalesced",
            "Misses that waited for another request's lookup of the same token",
            registry=reg,
        )
        self.cache_fallbacks = Counter(
            "llmchaos_gateway_token_cache_fallbacks",
            "Authentications that went to SQLite because Redis failed or was being skipped",
            registry=reg,
        )
        self.upstream_retries = Counter(
            "llmchaos_gateway_upstream_retries",
            "Requests retried on another worker, by the failure that caused it",
            ["reason"],
            registry=reg,
        )
        self.hedged_requests = Counter(
            "llmchaos_gateway_hedged_requests",
            "Requests also sent to a second worker after hedge_after_s without an answer, by "
            "which attempt answered first (first, hedge)",
            ["winner"],
            registry=reg,
        )
        self.upstream_failures = Counter(
            "llmchaos_gateway_upstream_failures",
            "Failed upstream attempts, by worker and failure",
            ["worker", "reason"],
            registry=reg,
        )
        self.broken_streams = Counter(
            "llmchaos_gateway_broken_streams",
            "Streams cut because the worker failed after the response had started",
            registry=reg,
        )
        self.client_disconnects = Counter(
            "llmchaos_gateway_client_disconnects",
            "Requests whose client went away before the end; the upstream request is cancelled",
            registry=reg,
        )
        reg.register(_PoolCollector(pool))
        # labels() takes a lock and builds a tuple; the label sets are few, so keep the children
        self._request_children: dict[tuple[str, int], Callable[[], None]] = {}
        self._latency_children: dict[str, Callable[[float], None]] = {}

    def observe_request(self, mode: str, status: int, duration_s: float) -> None:
        """Count one chat-completion response and its duration."""
        inc = self._request_children.get((mode, status))
        if inc is None:
            inc = self._requests.labels(mode=mode, code=str(status)).inc
            self._request_children[(mode, status)] = inc
        inc()
        observe = self._latency_children.get(mode)
        if observe is None:
            observe = self._latency.labels(mode=mode).observe
            self._latency_children[mode] = observe
        observe(duration_s)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)
