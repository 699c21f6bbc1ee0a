"""Forwarding one chat completion to a worker, with retry and hedging, plain or streamed.

The request body goes upstream as the bytes the client sent. An attempt first *fetches*: the
whole answer of a plain request, the headers and first chunk of a stream; nothing reaches the
client before one attempt has fetched. A failure until then (connect error or timeout, no
headers within `first_byte_timeout_s`, a 5xx, a body cut short) ejects the worker and is
retried on another one, up to `max_retries` times; without `failover` it is not retried and
goes to the client as it is. An attempt that has fetched nothing after `hedge_after_s` gets a
twin on another worker (within `hedge_budget_ratio` of the requests, prompts up to
`hedge_max_prompt_tokens`): the first to fetch answers the client, the other is cancelled.
Once a stream has started, a worker failure cuts the client's stream (the client sees a
truncated response, as behind any real proxy) and is counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from llmchaos.stack.gateway.metrics import GatewayMetrics
from llmchaos.stack.gateway.routing import Worker, WorkerPool
from llmchaos.stack.gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from llmchaos.stack.httpserver import Request, Responder, Response
from llmchaos.stack.openai_api import ApiError
from llmchaos.stack.settings import GatewaySettings

__all__ = ["Proxy"]

log = logging.getLogger(__name__)

_PASSED_HEADERS = ("traceparent", "tracestate", "x-request-id")


@dataclass
class _Fetched:
    """What an attempt got before anything went to the client."""

    worker: Worker
    upstream: UpstreamResponse
    headers: list[tuple[str, str]]
    body: bytes
    """The whole answer (plain, or a stream that is not 200), else the stream's first chunk."""
    streaming: bool


class _AttemptFailed(Exception):
    """One upstream attempt failed before anything reached the client."""

    def __init__(self, reason: str, response: Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response
        """The worker's own 5xx answer, returned as it is if no retry succeeds."""


def _failure_reason(exc: UpstreamError | TimeoutError) -> str:
    return exc.reason if isinstance(exc, UpstreamError) else "first_byte_timeout"


_HEDGE_BURST = 10.0
"""Hedges that may go out back to back (the token bucket's size)."""


class Proxy:
    """Sends requests to the workers chosen by the pool, over one shared session."""

    def __init__(
        self,
        settings: GatewaySettings,
        pool: WorkerPool,
        metrics: GatewayMetrics,
        upstream: UpstreamPool,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._upstream = upstream
        # no failover, no retry, no hedge: the client gets the first worker's answer
        self._max_retries = max(0, settings.max_retries) if settings.failover else 0
        self._hedge_after_s = max(0.0, settings.hedge_after_s) if settings.failover else 0.0
        self._hedge_budget_ratio = max(0.0, settings.hedge_budget_ratio)
        self._hedge_max_prompt_tokens = settings.hedge_max_prompt_tokens
        self._hedge_tokens = _HEDGE_BURST
        self._first_byte_timeout_s = settings.first_byte_timeout_s
        self._gateway_name = settings.name

    async def forward(
        self,
        request: Request,
        responder: Responder,
        path: str,
        body: bytes,
        stream: bool,
        tenant: str,
        prompt_tokens: int = 0,
        output_tokens: int = 0,
    ) -> tuple[int, Response | None, str]:
        """Proxy one request to `path` of a worker; returns the status, the answer (None when
        it was streamed through `responder`) and the serving mode ("none" if no worker
        answered). A prompt over `hedge_max_prompt_tokens` is never hedged; `output_tokens`
        (the most the request asks for) decides whether it may spill to a cpu worker
        (routing.py).

        Raises ApiError 503 `no_healthy_upstream` when no worker can be tried, 502/504 when
        every attempt failed without an answer.
        """
        headers = {"Content-Type": "application/json", "X-Tenant": tenant}
        for name in _PASSED_HEADERS:
            value = request.headers.get(name)
            # a value aiohttp could not send again (non-ASCII, control characters) is
            # dropped: tracing is the client's option, not a reason to fail its request
            if value is not None and value.isascii() and value.isprintable():
                headers[name] = value
        self._hedge_tokens = min(_HEDGE_BURST, self._hedge_tokens + self._hedge_budget_ratio)
        tried: list[Worker] = []
        running: dict[asyncio.Task[_Fetched], tuple[Worker, float]] = {}
        failure: _AttemptFailed | None = None
        retries_left = self._max_retries
        hedge_due = self._hedge_after_s > 0 and prompt_tokens <= self._hedge_max_prompt_tokens
        hedge: Worker | None = None

        def launch() -> bool:
            worker = self._pool.select(tried, output_tokens)
            if worker is None:
                return False
            tried.append(worker)
            worker.outstanding += 1
            task = asyncio.ensure_future(self._fetch(worker, path, body, headers, stream))
            running[task] = (worker, time.monotonic())
            return True

        try:
            launch()
            while running:
                done, _ = await asyncio.wait(
                    running,
                    timeout=self._hedge_after_s if hedge_due else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done:  # nothing fetched within hedge_after_s: a twin elsewhere
                    hedge_due = False
                    if self._hedge_tokens >= 1.0 and launch():
                        self._hedge_tokens -= 1.0
                        hedge = tried[-1]
                    continue
                for task in done:
                    worker, sent_at = running.pop(task)
                    exc = task.exception()
                    if exc is not None:
                        worker.outstanding -= 1
                        if not isinstance(exc, _AttemptFailed):
                            raise exc
                        answered = exc.response is not None
                        self._pool.eject(worker, exc.reason, answered=answered, sent_at=sent_at)
                        self._metrics.upstream_failures.labels(
                            worker=worker.name, reason=exc.reason
                        ).inc()
                        failure = exc
                        continue
                    fetched = task.result()
                    if hedge is not None:
                        winner = "hedge" if worker is hedge else "first"
                        self._metrics.hedged_requests.labels(winner=winner).inc()
                        if worker is hedge:
                            self._eject_outrun(running, worker, time.monotonic() - sent_at)
                    await self._cancel(running)  # the loser, or one that fetched as well
                    try:
                        answer = await self._deliver(request, responder, fetched)
                        return fetched.upstream.status, answer, worker.mode
                    finally:
                        worker.outstanding -= 1
                if not running and failure is not None and retries_left > 0:
                    retries_left -= 1
                    if launch():
                        self._metrics.upstream_retries.labels(reason=failure.reason).inc()
        finally:
            await self._cancel(running)
        if failure is None:
            raise ApiError(
                503,
                "no healthy upstream worker can take the request",
                type="server_error",
                code="no_healthy_upstream",
            )
        if failure.response is not None:
            return failure.response.status, failure.response, tried[-1].mode
        timed_out = failure.reason.endswith("timeout")
        raise ApiError(
            504 if timed_out else 502,
            f"upstream worker failed ({failure.reason}) on {len(tried)} attempt(s)",
            type="server_error",
            code="upstream_timeout" if timed_out else "upstream_unavailable",
        )

    def _eject_outrun(
        self,
        running: dict[asyncio.Task[_Fetched], tuple[Worker, float]],
        twin: Worker,
        twin_s: float,
    ) -> None:
        """The hedge answered first: its loser sat on the request for hedge_after_s and more.
        When the twin took less than hedge_after_s, the loser is an outlier among its peers
        (a slow link, a throttled CPU) and is ejected as a gray failure: its health checks
        pass, so it stays out for its ejection time. When the twin was slow too, the whole
        pool is (an overload): nobody is ejected, which would only shrink it. A cpu worker
        outrun by a gpu twin is not an outlier among its peers: it is the fallback, slow by
        design, and stays in."""
        if twin_s >= self._hedge_after_s:
            return
        for loser, sent_at in running.values():
            if loser.mode == "cpu" and twin.mode == "gpu":
                continue
            reason = f"hedge_timeout (a peer answered in {twin_s:.2f} s)"
            self._pool.eject(loser, reason, answered=True, sent_at=sent_at)
            self._metrics.upstream_failures.labels(worker=loser.name, reason="hedge_timeout").inc()

    @staticmethod
    async def _cancel(running: dict[asyncio.Task[_Fetched], tuple[Worker, float]]) -> None:
        """Cancel the attempts still running (a hedge's loser, or all when the client went
        away) and give back their connections and their workers' outstanding count."""
        tasks = list(running)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for task, result in zip(tasks, results, strict=True):
            worker, _ = running.pop(task)
            worker.outstanding -= 1
            if isinstance(result, _Fetched):
                result.upstream.release()

    async def _fetch(
        self, worker: Worker, path: str, body: bytes, headers: dict[str, str], stream: bool
    ) -> _Fetched:
        """One attempt up to the point where the client would first be sent something."""
        try:
            async with asyncio.timeout(self._first_byte_timeout_s):
                upstream = await self._upstream.post(worker.urls[path], body, headers)
        except (UpstreamError, TimeoutError) as exc:
            raise _AttemptFailed(_failure_reason(exc)) from None
        try:
            reply_headers = [
                ("X-Serving-Mode", worker.mode),
                ("X-Worker", upstream.headers.get("x-worker", worker.name)),
            ]
            streaming = stream and upstream.status == 200
            try:
                payload = await (upstream.readany() if streaming else upstream.read())
            except UpstreamError as exc:
                raise _AttemptFailed(_failure_reason(exc)) from None
            if upstream.status >= 500:
                content_type = upstream.headers.get("content-type", "application/json")
                response = Response(upstream.status, payload, content_type, reply_headers)
                raise _AttemptFailed(f"http_{upstream.status}", response)
        except BaseException:
            upstream.release()  # cancelled (a hedge lost) or failed: close, do not pool
            raise
        if not streaming:
            upstream.release()
        return _Fetched(worker, upstream, reply_headers, payload, streaming)

    async def _deliver(
        self, request: Request, responder: Responder, fetched: _Fetched
    ) -> Response | None:
        upstream = fetched.upstream
        if not fetched.streaming:
            content_type = upstream.headers.get("content-type", "application/json")
            return Response(upstream.status, fetched.body, content_type, fetched.headers)
        try:
            await self._relay_stream(request, responder, fetched)
            return None
        finally:
            # closes the connection instead of pooling it if the body was not read to the end
            upstream.release()

    async def _relay_stream(
        self, request: Request, responder: Responder, fetched: _Fetched
    ) -> None:
        worker, upstream = fetched.worker, fetched.upstream
        content_type = upstream.headers.get("content-type", "text/event-stream")
        headers = [("Content-Type", content_type), ("Cache-Control", "no-cache")]
        chunk = fetched.body
        try:
            await responder.start(upstream.status, [*headers, *fetched.headers])
            while chunk:
                await responder.write(chunk)
                try:
                    chunk = await upstream.readany()
                except UpstreamError as exc:
                    reason = _failure_reason(exc)
                    self._metrics.broken_streams.inc()
                    self._metrics.upstream_failures.labels(worker=worker.name, reason=reason).inc()
                    self._pool.eject(worker, f"stream broken: {reason}", answered=True)
                    # no final chunk: the client must see a broken stream, not a short one
                    request.transport.close()
                    return
            await responder.end()
        except ConnectionError:
            self._metrics.client_disconnects.inc()
