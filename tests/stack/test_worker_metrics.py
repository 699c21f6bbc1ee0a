"""The worker's own /metrics text (llmchaos.stack.worker_metrics) against prometheus_client's
for the same figures: the same bytes, whatever was observed."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    enable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmchaos.stack.engine import EngineStats, SequenceResult
from llmchaos.stack.openai_api import ApiError
from llmchaos.stack.worker_metrics import E2E_BUCKETS_S, TTFT_BUCKETS_S, WorkerMetrics


@pytest.fixture(autouse=True, scope="module")
def _no_created_series() -> Iterator[None]:
    """As the worker did: vLLM exports no *_created series (a switch of the whole process)."""
    disable_created_metrics()
    yield
    enable_created_metrics()


class _Reference(Collector):
    """The worker's metrics as prometheus_client writes them (the worker's code until
    2026-12-06)."""

    def __init__(self, stats: EngineStats, model: str) -> None:
        self.stats, self.model = stats, model
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            ["model_name"],
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        ).labels(model)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            ["model_name"],
            buckets=E2E_BUCKETS_S,
            registry=self.registry,
        ).labels(model)
        self.errors = Counter(
            "llmchaos:worker_request_errors",
            "Requests answered with an error, by OpenAI error code (or type).",
            ["model_name", "code"],
            registry=self.registry,
        )

    def collect(self) -> Iterator[Metric]:
        s, value = self.stats, [self.model]
        for name, doc, number in (
            ("vllm:num_requests_running", "Requests in the running batch.", s.running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means full.", s.kv_cache_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(value, number)
            yield gauge
        for name, doc, number in (
            ("vllm:num_preemptions", "Preemptions.", s.preemptions_total),
            ("vllm:prompt_tokens", "Prefilled prompt tokens.", s.prompt_tokens_total),
            ("vllm:generation_tokens", "Generated tokens.", s.generation_tokens_total),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(value, number)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success",
            "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        success.add_metric([self.model, "length"], s.finished_total)
        success.add_metric([self.model, "abort"], s.aborted_total)
        yield success


_counts = st.integers(min_value=0, max_value=10**9)
_stats = st.builds(
    EngineStats,
    running=_counts,
    waiting=_counts,
    kv_cache_usage=st.floats(min_value=0, max_value=1),
    kv_cache_used_tokens=_counts,
    preemptions_total=_counts,
    prompt_tokens_total=_counts,
    generation_tokens_total=_counts,
    finished_total=_counts,
    aborted_total=_counts,
    steps_total=_counts,
)
_seconds = st.one_of(
    st.sampled_from([*TTFT_BUCKETS_S, *E2E_BUCKETS_S]),  # on a bound: that bucket holds it
    st.floats(min_value=0, max_value=10_000, allow_nan=False),
)
_results = st.builds(
    SequenceResult,
    prompt_tokens=st.just(16),
    completion_tokens=st.just(8),
    finish_reason=st.sampled_from(["length", "length", "abort"]),
    queue_s=st.none(),
    ttft_s=st.one_of(st.none(), _seconds),
    e2e_s=_seconds,
    preemptions=st.just(0),
)


@given(
    stats=_stats,
    model=st.sampled_from(["llmchaos-7b", 'odd"model\\name\nx{}']),
    results=st.lists(_results, max_size=30),
    error_codes=st.lists(
        st.sampled_from(["model_loading", "worker_stopping", 'q"uote']), max_size=5
    ),
)
def test_the_exposition_is_prometheus_clients_text(
    stats: EngineStats,
    model: str,
    results: list[SequenceResult],
    error_codes: list[str],
) -> None:
    engine: Any = SimpleNamespace(stats=lambda: stats)
    ours = WorkerMetrics(engine, model)
    reference = _Reference(stats, model)
    for result in results:
        ours.observe(result)
        if result.finish_reason == "length" and result.ttft_s is not None:
            reference.ttft.observe(result.ttft_s)
            reference.e2e.observe(result.e2e_s)
    for code in error_codes:
        ours.count_error(ApiError(503, "x", type="service_unavailable", code=code))
        reference.errors.labels(model, code).inc()
    assert ours.exposition().decode() == generate_latest(reference.registry).decode()
