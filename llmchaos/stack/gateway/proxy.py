"""Forwarding one chat completion to a worker, with retry, plain or streamed.

The request body goes upstream as the bytes the client sent. A failure before anything was
sent to the client (connect error or timeout, no headers within `first_byte_timeout_s`, a
5xx, a plain body cut short) ejects the worker and is retried on another one, up to
`max_retries` times; without `failover` it is not retried and goes to the client as it is.
Once a stream has started, a worker failure cuts the client's stream (the client sees a
truncated response, as behind any real proxy) and is counted.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import web

from llmchaos.stack.gateway.metrics import GatewayMetrics
from llmchaos.stack.gateway.routing import Worker, WorkerPool
from llmchaos.stack.openai_api import ApiError
from llmchaos.stack.settings import GatewaySettings

__all__ = ["Proxy"]

log = logging.getLogger(__name__)

_PASSED_HEADERS = ("traceparent", "tracestate", "x-request-id")


class _AttemptFailed(Exception):
    """One upstream attempt failed before anything reached the client."""

    def __init__(self, reason: str, response: web.Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response
        """The worker's own 5xx answer, returned as it is if no retry succeeds."""


def _failure_reason(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "connect_timeout"
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return "read_timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect_error"
    if isinstance(exc, TimeoutError):
        return "first_byte_timeout"
    return "disconnect"


class Proxy:
    """Sends requests to the workers chosen by the pool, over one shared session."""

    def __init__(
        self,
        settings: GatewaySettings,
        pool: WorkerPool,
        metrics: GatewayMetrics,
        session: aiohttp.ClientSession,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._session = session
        # no failover, no retry: the client gets the first worker's failure
        self._max_retries = max(0, settings.max_retries) if settings.failover else 0
        self._first_byte_timeout_s = settings.first_byte_timeout_s
        self._gateway_name = settings.name
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=settings.connect_timeout_s,
            sock_read=settings.stream_idle_timeout_s,
        )

    async def forward(
        self, request: web.Request, path: str, body: bytes, stream: bool, tenant: str
    ) -> tuple[web.StreamResponse, str]:
        """Proxy one request to `path` of a worker; returns the response sent and the serving
        mode ("none" if no worker answered).

        Raises ApiError 503 `no_healthy_upstream` when no worker can be tried, 502/504 when
        every attempt failed without an answer.
        """
        headers = {"Content-Type": "application/json", "X-Tenant": tenant}
        for name in _PASSED_HEADERS:
            value = request.headers.get(name)
            # a value aiohttp could not send again (non-ASCII, bytes it decoded as surrogates)
            # is dropped: tracing is the client's option, not a reason to fail its request
            if value is not None and value.isascii() and value.isprintable():
                headers[name] = value
        tried: list[Worker] = []
        failure: _AttemptFailed | None = None
        for _attempt in range(self._max_retries + 1):
            worker = self._pool.select(tried)
            if worker is None:
                break
            if failure is not None:
                self._metrics.upstream_retries.labels(reason=failure.reason).inc()
            tried.append(worker)
            worker.outstanding += 1
            sent_at = time.monotonic()
            try:
                response = await self._attempt(request, worker, path, body, headers, stream)
            except _AttemptFailed as exc:
                answered = exc.response is not None
                self._pool.eject(worker, exc.reason, answered=answered, sent_at=sent_at)
                self._metrics.upstream_failures.labels(worker=worker.name, reason=exc.reason).inc()
                failure = exc
                continue
            finally:
                worker.outstanding -= 1
            return response, worker.mode
        if failure is None:
            raise ApiError(
                503,
                "no healthy upstream worker can take the request",
                type="server_error",
                code="no_healthy_upstream",
            )
        if failure.response is not None:
            return failure.response, tried[-1].mode
        timed_out = failure.reason.endswith("timeout")
        raise ApiError(
            504 if timed_out else 502,
            f"upstream worker failed ({failure.reason}) on {len(tried)} attempt(s)",
            type="server_error",
            code="upstream_timeout" if timed_out else "upstream_unavailable",
        )

    async def _attempt(
        self,
        request: web.Request,
        worker: Worker,
        path: str,
        body: bytes,
        headers: dict[str, str],
        stream: bool,
    ) -> web.StreamResponse:
        try:
            async with asyncio.timeout(self._first_byte_timeout_s):
                upstream = await self._session.post(
                    worker.urls[path], data=body, headers=headers, timeout=self._timeout
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _AttemptFailed(_failure_reason(exc)) from None
        try:
            reply_headers = {
                "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                "X-Serving-Mode": worker.mode,
                "X-Worker": upstream.headers.get("X-Worker", worker.name),
            }
            if not stream or upstream.status != 200:
                try:
                    payload = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise _AttemptFailed(_failure_reason(exc)) from None
                response = web.Response(body=payload, status=upstream.status, headers=reply_headers)
                if upstream.status >= 500:
                    raise _AttemptFailed(f"http_{upstream.status}", response)
                return response
            return await self._relay_stream(request, worker, upstream, reply_headers)
        finally:
            # closes the connection instead of pooling it if the body was not read to the end
            upstream.release()

    async def _relay_stream(
        self,
        request: web.Request,
        worker: Worker,
        upstream: aiohttp.ClientResponse,
        reply_headers: dict[str, str],
    ) -> web.StreamResponse:
        reply_headers["Cache-Control"] = "no-cache"
        response = web.StreamResponse(status=upstream.status, headers=reply_headers)
        await response.prepare(request)
        content = upstream.content
        while True:
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                reason = _failure_reason(exc)
                self._metrics.broken_streams.inc()
                self._metrics.upstream_failures.labels(worker=worker.name, reason=reason).inc()
                self._pool.eject(worker, f"stream broken: {reason}", answered=True)
                if request.transport is not None:
                    # no final chunk: the client must see a broken stream, not a short one
                    request.transport.close()
                return response
            if not chunk:
                break
            try:
                await response.write(chunk)
            except ConnectionError:
                self._metrics.client_disconnects.inc()
                return response
        await response.write_eof()
        return response
