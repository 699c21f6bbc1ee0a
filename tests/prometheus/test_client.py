"""The Prometheus client without a Prometheus: settings, PromQL building, and the failures
that need no server (nothing listening, a server that never answers)."""

from __future__ import annotations

import inspect
import math
import re
import socket
import time

import pytest

import probes.prometheus
from llmchaos import prometheus
from llmchaos.errors import InvalidInput, LLMChaosError
from llmchaos.prometheus import (
    Prometheus,
    PrometheusError,
    PrometheusNoData,
    PrometheusQueryError,
    PrometheusSettings,
    PrometheusUnreachable,
    error_rate_promql,
    latency_quantile_promql,
    promql_duration,
    query_scalar,
)


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("module", [prometheus, probes.prometheus], ids=["llmchaos", "probes"])
def test_all_lists_the_public_names(module: object) -> None:
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__  # type: ignore[attr-defined]
    }
    assert public <= set(module.__all__)  # type: ignore[attr-defined]


def test_errors_are_llmchaos_errors_and_distinct() -> None:
    kinds = (PrometheusUnreachable, PrometheusQueryError, PrometheusNoData)
    assert all(issubclass(kind, PrometheusError) for kind in kinds)
    assert issubclass(PrometheusError, LLMChaosError)
    assert not any(issubclass(a, b) for a in kinds for b in kinds if a is not b)


def test_probe_entry_points_take_the_url_and_window() -> None:
    for name in ("p99_latency_ms", "error_rate"):
        params = inspect.signature(getattr(probes.prometheus, name)).parameters
        assert list(params)[:2] == ["url", "window_s"], name
        assert inspect.getdoc(getattr(probes.prometheus, name))
    assert list(inspect.signature(probes.prometheus.query).parameters)[:2] == ["url", "promql"]


@pytest.mark.parametrize(
    ("window_s", "duration"),
    [(60, "60s"), (60.0, "60s"), (1.5, "1500ms"), (0.25, "250ms"), (3600, "3600s")],
)
def test_promql_durations_are_whole_units(window_s: float, duration: str) -> None:
    assert promql_duration(window_s) == duration


@pytest.mark.parametrize("window_s", [0, -5, math.inf, math.nan, True, "60", 0.0001])
def test_bad_windows_are_refused_before_any_query(window_s: object) -> None:
    with pytest.raises(InvalidInput, match="window_s"):
        promql_duration(window_s)  # type: ignore[arg-type]


def test_standard_promql() -> None:
    assert latency_quantile_promql(0.99, 30) == (
        "histogram_quantile(0.99, sum by (le) "
        "(rate(vllm:e2e_request_latency_seconds_bucket[30s]))) * 1000"
    )
    assert error_rate_promql(60) == (
        '(sum(rate(llmchaos_gateway_requests_total{code=~"5..|429"}[60s])) or vector(0))'
        " / sum(rate(llmchaos_gateway_requests_total[60s]))"
    )
    with pytest.raises(InvalidInput, match="quantile"):
        latency_quantile_promql(99, 30)


@pytest.mark.parametrize(
    ("url", "timeout_s", "message"),
    [
        ("prometheus:9090", 5, "expected http(s)://host:port"),
        ("ftp://prometheus:9090", 5, "expected http(s)://host:port"),
        ("http://", 5, "expected http(s)://host:port"),
        ("http://prometheus:9090", 0, "timeout_s: expected a number of seconds > 0"),
        ("http://prometheus:9090", math.inf, "timeout_s"),
    ],
)
def test_settings_are_checked(url: str, timeout_s: float, message: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(message)):
        PrometheusSettings(url=url, timeout_s=timeout_s)


def test_settings_are_frozen_with_defaults() -> None:
    settings = PrometheusSettings()
    assert (settings.url, settings.timeout_s) == ("http://127.0.0.1:9090", 10.0)
    with pytest.raises(AttributeError):
        settings.url = "http://elsewhere:9090"  # type: ignore[misc]


def test_unreachable_prometheus_names_the_url_and_the_query() -> None:
    url = f"http://127.0.0.1:{unused_port()}"
    with pytest.raises(PrometheusUnreachable) as caught:
        probes.prometheus.queue_depth(url, timeout_s=2)
    message = str(caught.value)
    assert url in message and "unreachable" in message and "num_requests_waiting" in message
    assert caught.value.url == url and caught.value.promql == "sum(vllm:num_requests_waiting)"


def test_prometheus_that_does_not_answer_times_out() -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(PrometheusUnreachable, match=r"did not answer within 0\.5 s"):
            query_scalar(Prometheus.at(url, timeout_s=0.5), "up")
        assert time.monotonic() - started < 3


def test_range_query_arguments_are_checked() -> None:
    prom = Prometheus.at(f"http://127.0.0.1:{unused_port()}")
    with pytest.raises(InvalidInput, match="start <= end"):
        prom.query_range("up", 200.0, 100.0, 1.0)
    with pytest.raises(InvalidInput, match="step_s > 0"):
        prom.query_range("up", 100.0, 200.0, 0)


def test_probe_arguments_given_as_strings_are_converted_or_refused() -> None:
    """Experiment arguments filled from the environment are strings: numbers are accepted."""
    url = f"http://127.0.0.1:{unused_port()}"
    with pytest.raises(PrometheusUnreachable, match=r"\[30s\]"):
        probes.prometheus.error_rate(url, window_s="30", timeout_s="1")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="window_s: expected a number of seconds, got 'abc'"):
        probes.prometheus.p99_latency_ms(url, window_s="abc")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="promql: expected a PromQL expression"):
        probes.prometheus.query(url, " ")
