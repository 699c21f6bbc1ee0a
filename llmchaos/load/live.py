"""The live endpoint of a running load: JSON windows, control, and Prometheus `/metrics`.

A plain WSGI app over a `LiveSource` (the master's Controller), so it needs no gevent itself;
process.py serves it with gevent's WSGI server inside the Locust master.

    GET  /status                          state, time zero, schedule position
    GET  /window?last_s=10                requests scheduled in the last 10 s
    GET  /window?since_ts=EPOCH[&until_ts=EPOCH]
    GET  /seconds?since_ts=EPOCH[&until_ts=EPOCH]
                                          per-second records of the seconds starting in
                                          [since_ts, until_ts or now), final or not
    GET  /summary                         the summary so far (final once state is "done")
    GET  /metrics                         Prometheus text: run totals + last-10 s gauges
    POST /control/qps?qps=N               change the total rate from now on
    POST /control/burst?duration_s=S&factor=F
    POST /control/stop                    stop scheduling, drain, write the summary

/seconds answers {"start_ts", "now_s", "seconds": [...]}; each item is the record of one
scheduled second, the same object as a line of the timeline file ("t", "ts", "scheduled",
"dropped", "lost_worker", "ok", "failed" by class, "modes", "tenants", "hist" with the
serialized histograms, "unanswered", and "latency_ms"/"ttft_ms"/"itl_ms"/"tpot_ms"/
"schedule_lag_ms" quantiles), plus "final": false while a worker can still add to it, and
"scheduled_in_full": true once every worker has reported its arrivals in it (answered or not).
"unanswered" = scheduled - dropped - lost_worker - answered at this moment. Seconds in which
nothing was scheduled have no item.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, Protocol
from urllib.parse import parse_qs

__all__ = ["LiveSource", "make_app", "prometheus_text"]

METRICS_WINDOW_S = 10.0
"""Window of the /metrics gauges (quantiles over the last 10 s of schedule)."""


class LiveSource(Protocol):
    def status(self) -> dict[str, Any]: ...
    def window(self, from_s: float, to_s: float) -> dict[str, Any]: ...
    def seconds(self, from_s: float, to_s: float) -> list[dict[str, Any]]: ...
    def summary(self) -> dict[str, Any]: ...
    def start_epoch_s(self) -> float | None: ...
    def now_s(self) -> float: ...
    def set_qps(self, qps: float) -> None: ...
    def burst(self, duration_s: float, factor: float) -> None: ...
    def stop(self) -> None: ...


class _BadRequest(Exception):
    pass


def _number(params: dict[str, list[str]], name: str, default: float | None = None) -> float:
    raw = params.get(name)
    if not raw:
        if default is None:
            raise _BadRequest(f"query parameter {name!r} is required")
        return default
    try:
        return float(raw[0])
    except ValueError:
        raise _BadRequest(f"{name}: expected a number, got {raw[0]!r}") from None


def _offsets(params: dict[str, list[str]], start: float, now_s: float) -> tuple[float, float]:
    """(from_s, to_s) schedule offsets of since_ts (required) and until_ts (default: now)."""
    return _number(params, "since_ts") - start, _number(params, "until_ts", start + now_s) - start


def make_app(source: LiveSource) -> Callable[..., Iterable[bytes]]:
    """The WSGI app of the live endpoint over `source`."""

    def route(method: str, path: str, params: dict[str, list[str]]) -> tuple[int, Any]:
        if method == "GET" and path == "/status":
            return 200, source.status()
        if method == "GET" and path == "/metrics":
            return 200, prometheus_text(source)
        if method == "POST" and path == "/control/stop":
            source.stop()
            return 200, {"stopping": True}
        if source.start_epoch_s() is None:
            return 409, {"error": "the load has not started yet"}
        start = source.start_epoch_s() or 0.0
        if method == "GET" and path == "/window":
            if "since_ts" in params:
                from_s, to_s = _offsets(params, start, source.now_s())
            else:
                to_s = source.now_s()
                from_s = to_s - _number(params, "last_s", 10.0)
            return 200, source.window(from_s, to_s)
        if method == "GET" and path == "/seconds":
            now_s = source.now_s()
            from_s, to_s = _offsets(params, start, now_s)
            body = {"start_ts": start, "now_s": round(now_s, 3)}
            return 200, {**body, "seconds": source.seconds(from_s, to_s)}
        if method == "GET" and path == "/summary":
            return 200, source.summary()
        if method == "POST" and path == "/control/qps":
            qps = _number(params, "qps")
            if qps < 0:
                raise _BadRequest(f"qps: expected >= 0, got {qps}")
            source.set_qps(qps)
            return 200, {"qps": qps}
        if method == "POST" and path == "/control/burst":
            duration_s = _number(params, "duration_s", 10.0)
            factor = _number(params, "factor", 1.0)
            if duration_s <= 0 or factor < 0:
                raise _BadRequest("burst: expected duration_s > 0 and factor >= 0")
            source.burst(duration_s, factor)
            return 200, {"duration_s": duration_s, "factor": factor}
        return 404, {"error": f"no route {method} {path}"}

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        params = parse_qs(environ.get("QUERY_STRING", ""))
        try:
            status, body = route(environ["REQUEST_METHOD"], environ["PATH_INFO"], params)
        except _BadRequest as exc:
            status, body = 400, {"error": str(exc)}
        if isinstance(body, str):
            data, ctype = body.encode(), "text/plain; version=0.0.4"
        else:
            data, ctype = json.dumps(body).encode(), "application/json"
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 409: "Conflict"}[status]
        start_response(
            f"{status} {reason}", [("Content-Type", ctype), ("Content-Length", str(len(data)))]
        )
        return [data]

    return app


def prometheus_text(source: LiveSource) -> str:
    """Prometheus exposition text: run totals as counters, the last 10 s as gauges."""
    lines: list[str] = []

    def metric(
        name: str, kind: str, help_text: str, samples: list[tuple[str, float | None]]
    ) -> None:
        lines.append(f"# HELP llmchaos_load_{name} {help_text}")
        lines.append(f"# TYPE llmchaos_load_{name} {kind}")
        for labels, value in samples:
            if value is not None:
                lines.append(f"llmchaos_load_{name}{labels} {value}")

    if source.start_epoch_s() is None:
        metric("up", "gauge", "1 once the load has started", [("", 0)])
        return "\n".join(lines) + "\n"
    total = source.summary()
    now = source.now_s()
    w = source.window(now - METRICS_WINDOW_S, now)
    metric("up", "gauge", "1 once the load has started", [("", 1)])
    metric("scheduled_total", "counter", "Requests scheduled", [("", total["scheduled"])])
    metric("ok_total", "counter", "Requests answered successfully", [("", total["ok"])])
    metric(
        "failed_total",
        "counter",
        "Failed requests by class",
        [(f'{{class="{c}"}}', n) for c, n in total["failed"].items()],
    )
    metric("dropped_total", "counter", "Sends over the in-flight cap", [("", total["dropped"])])
    metric("in_flight", "gauge", "Requests in flight", [("", total["in_flight"])])
    metric(
        "lost_worker_total",
        "counter",
        "Arrivals of lost workers' shares that no report holds",
        [("", total["lost_worker"])],
    )
    metric(
        "frame_drops_total",
        "counter",
        "Gaps >= 3 s without a success",
        [("", total["frame_drops"])],
    )
    metric("achieved_qps", "gauge", "Answered requests/s, last 10 s", [("", w["achieved_qps"])])
    metric(
        "goodput_qps",
        "gauge",
        "Requests/s that met every goodput SLO (TTFT, TPOT, E2E), last 10 s",
        [("", w["goodput_qps"])],
    )
    metric(
        "output_tokens_per_s",
        "gauge",
        "Output tokens/s of the successes, last 10 s",
        [("", w["output_tokens_per_s"])],
    )
    for name, help_text in (
        ("latency_ms", "Latency from scheduled send time, last 10 s"),
        ("ttft_ms", "Time to first non-empty content chunk from scheduled send time, last 10 s"),
        ("itl_ms", "Gaps between successive content chunks of streams, last 10 s"),
        (
            "tpot_ms",
            "Time per output token after the first, (e2e - TTFT) / (tokens - 1), last 10 s",
        ),
        ("schedule_lag_ms", "Request on the socket minus scheduled time, last 10 s"),
    ):
        metric(
            name,
            "gauge",
            help_text,
            [
                (f'{{quantile="{q}"}}', w[name][key])
                for q, key in (("0.5", "p50"), ("0.9", "p90"), ("0.99", "p99"), ("0.999", "p999"))
            ],
        )
    metric(
        "error_rate",
        "gauge",
        "Failed share by class, last 10 s",
        [(f'{{class="{c}"}}', r) for c, r in w["error_rate_by_class"].items()],
    )
    metric(
        "serving_mode_share",
        "gauge",
        "Share of answers by X-Serving-Mode, last 10 s",
        [(f'{{mode="{m}"}}', s) for m, s in w["serving_mode_share"].items()],
    )
    return "\n".join(lines) + "\n"
