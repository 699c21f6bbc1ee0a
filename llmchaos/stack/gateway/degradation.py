"""Degraded mode: when the engines are overloaded, serve everyone shorter answers.

The gateway reads every worker's /metrics each `poll_interval_s` (vLLM's names): the queue is
the sum of `vllm:num_requests_waiting`, the P99 is `histogram_quantile(0.99, ...)` of the
`vllm:e2e_request_latency_seconds` buckets of the requests finished within
`latency_window_s` (the increase of each worker's buckets, a restarted worker's reset
counted from zero). It degrades

- at once when the queue passes `queue_depth_threshold` (reason `queue_depth`), or
- when the P99 has stayed over `latency_p99_ms` for `latency_for_s` (reason `latency_p99`;
  a poll without finished requests breaks the run, as a Prometheus alert's `for` does),

and leaves degraded mode once the queue is at most `recover_queue_ratio` of the threshold and
the P99 under its limit for `hold_s`. Entering logs `DEGRADED: true` (leaving `DEGRADED:
false`) and counts `service_degraded_total{reason}`; `llmchaos_gateway_degraded` is 1 while
degraded and `llmchaos_gateway_engine_queue` the last queue read.

While degraded, a request that arrives while the engines' queue (last read) is still past
the threshold is shed at once with 429 and `Retry-After` (it would only wait there: the queue
is what an engine that is short of prefill or batch capacity cannot absorb), and an admitted
one has its max_tokens (and max_completion_tokens) above `degraded_max_tokens` cut to it, so it
holds an engine slot for fewer decode steps and the queue drains; both answers carry
`X-Degraded: true` (admitted ones counted in `llmchaos_gateway_degraded_requests_total`, shed
ones in `llmchaos_gateway_degraded_shed_total`). The gateway's own shedding on its estimated
queue (`queue_shed_threshold`, twice the degradation threshold) stays the last line when the
degradation trigger is missing or late.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge
from yarl import URL

from llmchaos.stack.openai_api import ApiError, GenerationRequest
from llmchaos.stack.settings import DegradationSettings

__all__ = [
    "DEGRADED_HEADER",
    "DEGRADED_HEADERS",
    "Degradation",
    "DegradationState",
    "EngineScrape",
    "LatencyWindow",
    "cap_max_tokens",
    "histogram_quantile",
    "parse_engine_metrics",
]

log = logging.getLogger("llmchaos.stack.gateway")

DEGRADED_HEADER = "X-Degraded"
DEGRADED_HEADERS = ((DEGRADED_HEADER, "true"),)
"""On every answer to a request admitted while degraded (a shed 429 too)."""
_WAITING = "vllm:num_requests_waiting"
_E2E_BUCKET = "vllm:e2e_request_latency_seconds_bucket"


@dataclass(frozen=True)
class EngineScrape:
    """What one worker's /metrics says: its queue and its cumulative e2e buckets."""

    waiting: float
    buckets: dict[float, float]
    """Upper bound in seconds (inf included) -> cumulative count."""


def parse_engine_metrics(text: str) -> EngineScrape:
    """The queue and e2e buckets of a vLLM /metrics text (samples summed over labels)."""
    waiting = 0.0
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(_WAITING):
            waiting += float(line.rsplit(" ", 1)[1])
        elif line.startswith(_E2E_BUCKET):
            start = line.index('le="') + 4
            bound = float(line[start : line.index('"', start)])
            buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return EngineScrape(waiting, buckets)


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative `buckets` (bound -> count): linear
    interpolation inside the bucket holding the rank; the highest finite bound when it falls
    in the +Inf bucket; None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    previous_bound, previous_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return previous_bound
            if count == previous_count:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (
                count - previous_count
            )
        previous_bound, previous_count = bound, count
    return previous_bound


class LatencyWindow:
    """The e2e buckets of the requests finished within the last `window_s`, from cumulative
    scrapes of several workers: a worker's first scrape is its baseline, and a counter that
    went down was reset (a restarted worker), so everything it shows then is new."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._last: dict[str, dict[float, float]] = {}
        self._increases: deque[tuple[float, dict[float, float]]] = deque()

    def add(self, now: float, scrapes: dict[str, EngineScrape]) -> None:
        """Record the increase since each worker's previous scrape."""
        increase: dict[float, float] = {}
        for worker, scrape in scrapes.items():
            before = self._last.get(worker)
            self._last[worker] = dict(scrape.buckets)
            if before is None:
                continue  # a worker seen for the first time: its history is the baseline
            reset = any(count < before.get(b, 0.0) for b, count in scrape.buckets.items())
            for bound, count in scrape.buckets.items():
                delta = count if reset else count - before.get(bound, 0.0)
                increase[bound] = increase.get(bound, 0.0) + delta
        self._increases.append((now, increase))
        while self._increases and self._increases[0][0] <= now - self._window_s:
            self._increases.popleft()

    def p99_ms(self) -> float | None:
        """P99 in ms of the window's requests; None when none finished in it."""
        total: dict[float, float] = {}
        for _, increase in self._increases:
            for bound, count in increase.items():
                total[bound] = total.get(bound, 0.0) + count
        value = histogram_quantile(0.99, total)
        return None if value is None else value * 1000.0


class DegradationState:
    """The rules of the module docstring over readings at times `now` (seconds, monotonic)."""

    def __init__(self, settings: DegradationSettings) -> None:
        self.settings = settings
        self.degraded = False
        self.reason = ""
        self._slow_since: float | None = None
        self._calm_since: float | None = None

    def observe(self, now: float, queue: float, p99_ms: float | None) -> str | None:
        """Take one reading; returns "enter:<reason>" or "leave" on a change, else None."""
        s = self.settings
        slow = p99_ms is not None and p99_ms > s.latency_p99_ms
        self._slow_since = (self._slow_since or now) if slow else None
        if not self.degraded:
            if s.queue_rule and queue > s.queue_depth_threshold:
                return self._enter("queue_depth")
            if self._slow_since is not None and now - self._slow_since >= s.latency_for_s:
                return self._enter("latency_p99")
            return None
        calm = queue <= s.recover_queue_ratio * s.queue_depth_threshold and not slow
        self._calm_since = (self._calm_since or now) if calm else None
        if self._calm_since is not None and now - self._calm_since >= s.hold_s:
            self.degraded, self._calm_since = False, None
            return "leave"
        return None

    def _enter(self, reason: str) -> str:
        self.degraded, self.reason, self._calm_since = True, reason, None
        return f"enter:{reason}"


def cap_max_tokens(body: bytes, generation: GenerationRequest, limit: int) -> bytes:
    """`body` with max_tokens (and max_completion_tokens) cut to `limit` and min_tokens kept
    within it; the same bytes when the request already asks for no more (without max_tokens:
    the endpoint's default, 32 for chat and 16 for completions, which the worker applies)."""
    if generation.output_tokens <= limit:
        return body
    data = json.loads(body)
    data["max_tokens"] = limit
    if data.get("max_completion_tokens") is not None:
        data["max_completion_tokens"] = limit
    if isinstance(data.get("min_tokens"), int) and data["min_tokens"] > limit:
        data["min_tokens"] = limit
    return json.dumps(data).encode()


class Degradation:
    """One gateway's degraded mode: `install(app)`, `run(session)` as a task, `admit(...)` on
    every generation request."""

    def __init__(
        self,
        settings: DegradationSettings,
        metrics_urls: Callable[[], Iterable[tuple[str, URL]]],
        registry: CollectorRegistry,
        retry_after_s: int = 1,
    ) -> None:
        """`metrics_urls`: (worker name, its /metrics URL) of the current upstream workers;
        `retry_after_s`: the Retry-After of a shed request."""
        self.state = DegradationState(settings)
        self._retry_after_s = retry_after_s
        self._settings = settings
        self._metrics_urls = metrics_urls
        self._latency = LatencyWindow(settings.latency_window_s)
        self._timeout = aiohttp.ClientTimeout(total=max(0.2, settings.poll_interval_s))
        self.queue = 0.0
        self.p99_ms: float | None = None
        self._entered = Counter(
            "service_degraded",
            "Times the gateway entered degraded mode, by the rule that fired",
            ["reason"],
            registry=registry,
        )
        for reason in ("queue_depth", "latency_p99"):
            self._entered.labels(reason=reason)  # 0 from the start: a jump is visible
        self._answers = Counter(
            "llmchaos_gateway_degraded_requests",
            "Requests admitted in degraded mode (max_tokens cut, X-Degraded: true)",
            registry=registry,
        )
        self._shed = Counter(
            "llmchaos_gateway_degraded_shed",
            "Requests shed with 429 in degraded mode while the engines' queue was past the "
            "threshold",
            registry=registry,
        )
        gauge = Gauge(
            "llmchaos_gateway_degraded", "1 while the gateway is degraded", registry=registry
        )
        gauge.set_function(lambda: 1.0 if self.state.degraded else 0.0)
        queue = Gauge(
            "llmchaos_gateway_engine_queue",
            "Sum of the engines' vllm:num_requests_waiting at the last read",
            registry=registry,
        )
        queue.set_function(lambda: self.queue)

    def admit(self, generation: GenerationRequest, body: bytes) -> tuple[bytes, bool]:
        """The body to forward (as it came, or with max_tokens cut while degraded) and
        whether the gateway is degraded (its answer then carries DEGRADED_HEADERS). Raises
        ApiError 429 with Retry-After while degraded and the engines' queue is still past the
        threshold."""
        if not self.state.degraded:
            return body, False
        threshold = self._settings.queue_depth_threshold
        if self.queue > threshold:
            self._shed.inc()
            raise ApiError(
                429,
                f"Gateway degraded: the engines' queue is {self.queue:g} > {threshold}; retry "
                f"after {self._retry_after_s} s",
                type="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self._retry_after_s), **dict(DEGRADED_HEADERS)},
            )
        self._answers.inc()
        return cap_max_tokens(body, generation, self._settings.degraded_max_tokens), True

    def output_tokens(self, degraded: bool, generation: GenerationRequest) -> int:
        """The most output tokens a request admitted (`degraded` or not) asks for, after
        admit's cut."""
        if degraded:
            return min(generation.output_tokens, self._settings.degraded_max_tokens)
        return generation.output_tokens

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Read the engines every poll interval until cancelled."""
        interval_s = self._settings.poll_interval_s
        while True:
            started = time.monotonic()
            await self.poll(session)
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    async def poll(self, session: aiohttp.ClientSession) -> str | None:
        """One read of every engine and one step of the rules; returns the change, if any."""
        targets = list(self._metrics_urls())
        texts = await asyncio.gather(*(self._scrape(session, url) for _, url in targets))
        scrapes = {
            name: parse_engine_metrics(text)
            for (name, _), text in zip(targets, texts, strict=True)
            if text is not None
        }
        now = time.monotonic()
        self._latency.add(now, scrapes)
        # a worker that does not answer holds no queue we could see (dead, or partitioned)
        self.queue = sum(s.waiting for s in scrapes.values())
        self.p99_ms = self._latency.p99_ms()
        change = self.state.observe(now, self.queue, self.p99_ms)
        if change is not None:
            self._report(change)
        return change

    async def _scrape(self, session: aiohttp.ClientSession, url: URL) -> str | None:
        try:
            async with session.get(url, timeout=self._timeout) as response:
                return await response.text() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    def _report(self, change: str) -> None:
        s = self._settings
        p99 = "-" if self.p99_ms is None else f"{self.p99_ms:.0f}"
        figures = (
            f"queue={self.queue:g} threshold={s.queue_depth_threshold} p99_ms={p99} "
            f"latency_p99_ms={s.latency_p99_ms:g}"
        )
        if change.startswith("enter:"):
            reason = change.removeprefix("enter:")
            self._entered.labels(reason=reason).inc()
            log.warning(
                "DEGRADED: true reason=%s %s max_tokens<=%d",
                reason,
                figures,
                s.degraded_max_tokens,
            )
        else:
            log.warning("DEGRADED: false %s", figures)
