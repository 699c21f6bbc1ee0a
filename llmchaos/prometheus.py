"""A small client for the Prometheus HTTP API, and the standard queries of llmchaos.

    prom = Prometheus.at("http://127.0.0.1:9090")
    p99_latency_ms(prom, window_s=60)     # P99 from vllm:e2e_request_latency_seconds, ms
    error_rate(prom, window_s=60)         # gateway answers 5xx or 429 / all answers
    queue_depth(prom)                     # sum(vllm:num_requests_waiting)
    query_scalar(prom, "sum(up)")         # any PromQL returning one number
    prom.query("up")                      # instant vector: list of Sample
    prom.query_range("up", start, end, step_s=5)   # matrix: list of Series

These read the target's own metrics (server side): in a cluster they are what there is. The
open-loop load (probes.slo) is the client's view and the stricter one: it times requests from
their scheduled send time and counts what never reached a gateway (HAProxy's 503s, refused
connections), which no server-side metric sees.

Every failure is a `PrometheusError` whose message names the Prometheus URL, the PromQL and
what went wrong: `PrometheusUnreachable` (no answer), `PrometheusQueryError` (Prometheus
answered with an error, e.g. a PromQL parse error, or the answer is not one number) and
`PrometheusNoData` (an empty result or NaN: nothing was measured, which is not 0).
"""

from __future__ import annotations

import http.client
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmchaos.errors import InvalidInput, LLMChaosError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "QUEUE_DEPTH_PROMQL",
    "Prometheus",
    "PrometheusError",
    "PrometheusNoData",
    "PrometheusQueryError",
    "PrometheusSettings",
    "PrometheusUnreachable",
    "Sample",
    "Series",
    "error_rate",
    "error_rate_promql",
    "latency_quantile_promql",
    "p99_latency_ms",
    "promql_duration",
    "query_scalar",
    "queue_depth",
]

DEFAULT_TIMEOUT_S = 10.0
"""Deadline of one query: a probe that hangs on a dead Prometheus holds the experiment."""

QUEUE_DEPTH_PROMQL = "sum(vllm:num_requests_waiting)"
"""Requests waiting in every engine's scheduler now (vLLM's gauge, summed over workers)."""

_ERROR_CODES = "5..|429"
"""Gateway status codes counted as errors: server errors and shedding. 4xx client errors (bad
token, unknown model) are the client's fault and would make a chaos verdict depend on the
load's bad-token share."""

_MAX_BODY_IN_MESSAGE = 300


class PrometheusError(LLMChaosError):
    """A Prometheus query failed; `url` and `promql` say which."""

    def __init__(self, message: str, *, url: str, promql: str) -> None:
        super().__init__(message)
        self.url = url
        self.promql = promql


class PrometheusUnreachable(PrometheusError):
    """No HTTP answer from Prometheus: refused, unknown host, or no answer before the timeout."""


class PrometheusQueryError(PrometheusError):
    """Prometheus answered with an error (bad PromQL, evaluation failed or timed out), with
    something that is not its API, or with a result that is not the one number asked for."""


class PrometheusNoData(PrometheusError):
    """The query matched no series, or its value is NaN (e.g. a rate over zero requests):
    nothing was measured. Deliberately not 0: "no errors" and "no data" are different."""


@dataclass(frozen=True)
class PrometheusSettings:
    """Where Prometheus is and how long to wait for it."""

    url: str = "http://127.0.0.1:9090"
    """Base URL of the Prometheus HTTP API, without /api/v1: http://prometheus:9090, or with
    the path prefix of a server behind a proxy (Thanos Query, Mimir's /prometheus)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Deadline of one HTTP request; also sent as the query's `timeout`, so Prometheus stops
    evaluating when the client stops waiting."""

    def __post_init__(self) -> None:
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise InvalidInput(
                f"Prometheus url: expected http(s)://host:port[/prefix], got {self.url!r}"
            )
        if not (isinstance(self.timeout_s, int | float) and 0 < self.timeout_s < math.inf):
            raise InvalidInput(
                f"Prometheus timeout_s: expected a number of seconds > 0, got {self.timeout_s!r}"
            )


@dataclass(frozen=True)
class Sample:
    """One element of an instant query's result."""

    labels: Mapping[str, str]
    """The series' labels ({} for a scalar or an aggregation without `by`)."""
    value: float
    timestamp: float
    """Evaluation time, epoch seconds."""


@dataclass(frozen=True)
class Series:
    """One series of a range query's result."""

    labels: Mapping[str, str]
    points: tuple[tuple[float, float], ...]
    """(epoch seconds, value) by time; NaN where the expression had no value."""


class Prometheus:
    """A client of one Prometheus server's HTTP API (blocking, stdlib only). Every query
    raises PrometheusUnreachable or PrometheusQueryError when it fails."""

    def __init__(self, settings: PrometheusSettings) -> None:
        self.settings = settings
        self._base = settings.url.rstrip("/")

    @classmethod
    def at(cls, url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Prometheus:
        """The client of the server at `url`. Raises InvalidInput for a bad url or timeout."""
        return cls(PrometheusSettings(url=url, timeout_s=timeout_s))

    @property
    def url(self) -> str:
        return self.settings.url

    def query(self, promql: str, at: float | None = None) -> list[Sample]:
        """Instant query (/api/v1/query) at epoch `at` (None: now): the samples of its vector,
        or one unlabelled sample for a scalar. An empty list is a valid answer here; callers
        that need a number use query_scalar."""
        params = {"query": promql}
        if at is not None:
            params["time"] = _epoch(at)
        data = self._call("query", params, promql)
        kind, result = data.get("resultType"), data.get("result")
        if kind == "vector" and isinstance(result, list):
            return [
                Sample(dict(item.get("metric", {})), _float(item["value"][1]), item["value"][0])
                for item in result
            ]
        if kind == "scalar" and isinstance(result, list):
            return [Sample({}, _float(result[1]), result[0])]
        if kind == "matrix":
            raise self._error(
                PrometheusQueryError,
                promql,
                "the result is a range vector; an instant query needs an instant vector "
                "(wrap the selector in a function such as rate(...[1m])), or use query_range",
            )
        raise self._error(
            PrometheusQueryError,
            promql,
            f"expected a vector or scalar result, got resultType {kind!r}",
        )

    def query_range(self, promql: str, start: float, end: float, step_s: float) -> list[Series]:
        """Range query (/api/v1/query_range) from `start` to `end` (epoch seconds) every
        `step_s` seconds. Raises InvalidInput for end < start or step_s <= 0."""
        if not (math.isfinite(start) and math.isfinite(end) and start <= end):
            raise InvalidInput(f"query_range: expected start <= end, got {start} .. {end}")
        if not (math.isfinite(step_s) and step_s > 0):
            raise InvalidInput(f"query_range: expected step_s > 0, got {step_s}")
        params = {"query": promql, "start": _epoch(start), "end": _epoch(end), "step": f"{step_s}"}
        data = self._call("query_range", params, promql)
        if data.get("resultType") != "matrix" or not isinstance(data.get("result"), list):
            raise self._error(
                PrometheusQueryError,
                promql,
                f"expected a matrix result, got resultType {data.get('resultType')!r}",
            )
        return [
            Series(
                dict(item.get("metric", {})),
                tuple((float(t), _float(v)) for t, v in item.get("values", [])),
            )
            for item in data["result"]
        ]

    def _call(self, endpoint: str, params: dict[str, str], promql: str) -> dict[str, Any]:
        """POST one API call and return its `data`. POST: long PromQL does not meet URL limits."""
        url = f"{self._base}/api/v1/{endpoint}"
        timeout_s = self.settings.timeout_s
        # Prometheus durations take integers only ("5.0s" is a bad_data error): whole ms.
        timeout = promql_duration(timeout_s)
        body = urllib.parse.urlencode({**params, "timeout": timeout}).encode()
        request = urllib.request.Request(
            url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/x-www-form-urlencoded",
                "Accept": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                raw = response.read()
                status = response.status
        except urllib.error.HTTPError as exc:
            # Prometheus answers bad PromQL with 400 (422 for evaluation errors, 503 for
            # timeouts) and its error in the JSON body: that body is the useful part.
            raw, status = exc.read(), exc.code
        except (OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
                what = f"did not answer within {timeout_s} s"
            else:
                what = f"is unreachable ({reason})"
            raise self._error(
                PrometheusUnreachable,
                promql,
                f"{what}; expected a running Prometheus at this base URL "
                "(e.g. http://prometheus:9090, without /api/v1)",
            ) from None
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or "status" not in answer:
            text = raw[:_MAX_BODY_IN_MESSAGE].decode(errors="replace")
            raise self._error(
                PrometheusQueryError,
                promql,
                f"HTTP {status} with a body that is not the Prometheus API's JSON ({text!r}); "
                f"is {self.url} the base URL of Prometheus (without /api/v1)?",
            )
        if answer["status"] != "success":
            raise self._error(
                PrometheusQueryError,
                promql,
                f"Prometheus answered HTTP {status} {answer.get('errorType', 'error')}: "
                f"{answer.get('error', '(no error text)')}",
            )
        data = answer.get("data")
        if not isinstance(data, dict):
            raise self._error(PrometheusQueryError, promql, "the answer has no `data` object")
        return data

    def _error(self, kind: type[PrometheusError], promql: str, what: str) -> PrometheusError:
        return _failure(kind, self.url, promql, what)


def query_scalar(prom: Prometheus, promql: str, at: float | None = None) -> float:
    """The one number `promql` evaluates to now (or at epoch `at`).

    Raises PrometheusNoData for an empty result or NaN, PrometheusQueryError when the result
    has several series (aggregate them: sum(...), max(...)).
    """
    samples = prom.query(promql, at)
    if not samples:
        raise _failure(
            PrometheusNoData,
            prom.url,
            promql,
            "no data: the result is empty (no series matched; are the targets scraped, and "
            "did the window see any samples?). An empty result is not 0",
        )
    if len(samples) > 1:
        shown = ", ".join(_labels(s.labels) for s in samples[:3])
        raise _failure(
            PrometheusQueryError,
            prom.url,
            promql,
            f"expected one number, got {len(samples)} series ({shown}"
            f"{', ...' if len(samples) > 3 else ''}); aggregate them, e.g. sum(...) or max(...)",
        )
    value = samples[0].value
    if math.isnan(value):
        raise _failure(
            PrometheusNoData,
            prom.url,
            promql,
            "no data: the value is NaN (e.g. a rate or quantile over zero requests in the "
            "window); NaN is not 0",
        )
    return value


def promql_duration(window_s: float) -> str:
    """A PromQL range duration for `window_s` seconds: "60s", or "1500ms" when not whole
    (PromQL durations take integers only). Raises InvalidInput unless 0 < window_s < inf."""
    if isinstance(window_s, bool) or not isinstance(window_s, int | float):
        raise InvalidInput(f"window_s: expected a number of seconds, got {window_s!r}")
    if not (0 < window_s < math.inf):
        raise InvalidInput(f"window_s: expected seconds > 0, got {window_s}")
    ms = round(window_s * 1000)
    if ms < 1:
        raise InvalidInput(f"window_s: expected at least 0.001 s, got {window_s}")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def latency_quantile_promql(quantile: float, window_s: float) -> str:
    """PromQL of the `quantile` of end-to-end latency in ms over all workers, from vLLM's
    histogram (linear interpolation inside the bucket holding the quantile)."""
    if not 0 < quantile < 1:
        raise InvalidInput(f"quantile: expected 0 < quantile < 1, got {quantile}")
    window = promql_duration(window_s)
    return (
        f"histogram_quantile({quantile}, sum by (le) "
        f"(rate(vllm:e2e_request_latency_seconds_bucket[{window}]))) * 1000"
    )


def error_rate_promql(window_s: float) -> str:
    """PromQL of the share of gateway answers that were 5xx or 429 over the window."""
    window = promql_duration(window_s)
    total = f"sum(rate(llmchaos_gateway_requests_total[{window}]))"
    # `or vector(0)`: with no error at all the error series do not exist, and the ratio must
    # be 0, not "no data". With no answers at all the denominator is empty: no data, rightly.
    errors = f'sum(rate(llmchaos_gateway_requests_total{{code=~"{_ERROR_CODES}"}}[{window}]))'
    return f"({errors} or vector(0)) / {total}"


def p99_latency_ms(prom: Prometheus, window_s: float, at: float | None = None) -> float:
    """P99 end-to-end latency in ms over the last `window_s` seconds, from the engines'
    vllm:e2e_request_latency_seconds histogram. Only requests the engines finished: time in
    the gateway and HAProxy, and requests that failed before an engine, are not in it. The
    window should hold at least 4 scrapes. PrometheusNoData when no request finished in it."""
    return query_scalar(prom, latency_quantile_promql(0.99, window_s), at)


def error_rate(prom: Prometheus, window_s: float, at: float | None = None) -> float:
    """Share (0..1) of the gateways' chat-completion answers over the last `window_s` seconds
    that were 5xx or 429, from llmchaos_gateway_requests_total{code}. PrometheusNoData when
    no request was answered in the window."""
    return query_scalar(prom, error_rate_promql(window_s), at)


def queue_depth(prom: Prometheus, at: float | None = None) -> float:
    """Requests waiting in the engines' schedulers: sum(vllm:num_requests_waiting)."""
    return query_scalar(prom, QUEUE_DEPTH_PROMQL, at)


def _failure(kind: type[PrometheusError], url: str, promql: str, what: str) -> PrometheusError:
    return kind(f"Prometheus {url}, query {promql!r}: {what}", url=url, promql=promql)


def _epoch(value: float) -> str:
    return f"{value:.3f}"


def _float(value: Any) -> float:
    # Prometheus sends sample values as strings: "1.5", "NaN", "+Inf".
    return float(value)


def _labels(labels: Mapping[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
