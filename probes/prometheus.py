"""Server-side probes read from Prometheus with PromQL: usable in any Chaos Toolkit experiment.

Unlike probes.slo and probes.target they need no llmchaos control or run: each call talks to
the Prometheus at `url` (its base URL, e.g. http://prometheus:9090) and returns one number.
`window_s` is the PromQL range of rate(); keep it at least 4 scrape intervals. A probe whose
query has no data (no series, or NaN such as a rate over zero requests) raises instead of
returning 0, so a dead scrape can never pass a steady-state hypothesis.

    {"type": "probe", "name": "p99", "tolerance": {"type": "range", "range": [0, 2000]},
     "provider": {"type": "python", "module": "probes.prometheus", "func": "p99_latency_ms",
                  "arguments": {"url": "http://prometheus:9090", "window_s": 60}}}
"""

from __future__ import annotations

from llmchaos import prometheus
from llmchaos.errors import InvalidInput
from llmchaos.prometheus import DEFAULT_TIMEOUT_S, Prometheus

__all__ = ["error_rate", "p99_latency_ms", "query", "queue_depth"]


def p99_latency_ms(url: str, window_s: float = 60.0, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """P99 end-to-end latency in ms over the last `window_s` seconds, from the engines'
    vllm:e2e_request_latency_seconds histogram (histogram_quantile, summed over workers)."""
    return prometheus.p99_latency_ms(_client(url, timeout_s), _seconds("window_s", window_s))


def error_rate(url: str, window_s: float = 60.0, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """Share (0..1) of the gateways' answers over the last `window_s` seconds that were 5xx or
    429, from llmchaos_gateway_requests_total{code}."""
    return prometheus.error_rate(_client(url, timeout_s), _seconds("window_s", window_s))


def queue_depth(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """Requests waiting in the engines now: sum(vllm:num_requests_waiting)."""
    return prometheus.queue_depth(_client(url, timeout_s))


def query(url: str, promql: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """The one number any PromQL expression evaluates to now (aggregate several series with
    sum(...) or max(...); several series are an error, not a silent pick)."""
    if not isinstance(promql, str) or not promql.strip():
        raise InvalidInput(f"promql: expected a PromQL expression, got {promql!r}")
    return prometheus.query_scalar(_client(url, timeout_s), promql)


def _client(url: str, timeout_s: float | str) -> Prometheus:
    return Prometheus.at(url, _seconds("timeout_s", timeout_s))


def _seconds(name: str, value: float | str) -> float:
    # Experiment arguments filled from configuration or the environment arrive as strings.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise InvalidInput(f"{name}: expected a number of seconds, got {value!r}") from None
    return value
