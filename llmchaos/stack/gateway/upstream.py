"""The gateway's HTTP/1.1 client to its workers: keep-alive connections pooled per worker.

aiohttp's client session cost about a third of the gateway's CPU per proxied request (request
and response objects, payload writers, a timeout rescheduled on every read). This client does
what the proxy needs and no more: one write per request (head and body together), the answer
parsed by httptools (llhttp, as in Node.js) as it arrives, the body read whole or chunk by
chunk, and the connection back in the pool once the answer was read to its end.

Failures are UpstreamFailed with the reason the proxy records: `connect_error`,
`connect_timeout`, `first_byte_timeout` (no status and headers within the request's limit),
`read_timeout` (nothing for `read_timeout_s` while waiting for the answer) and `disconnect`
(the connection ended before the answer did, or the answer is not HTTP). The timeouts are
timers armed only while waiting, not asyncio.timeout scopes (a few % of the CPU per request).
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

import httptools
from yarl import URL

__all__ = ["UpstreamClient", "UpstreamFailed", "UpstreamResponse"]

_PAUSE_BYTES = 1 << 20
"""Body bytes buffered before the client stops reading a worker faster than its client."""


class UpstreamFailed(Exception):
    """An upstream request failed before its answer was complete; `reason` names how."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class _Connection(asyncio.Protocol):
    """One keep-alive connection; answers are parsed into `UpstreamResponse`s."""

    def __init__(self, read_timeout_s: float) -> None:
        self._read_timeout_s = read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.idle_since = 0.0
        self.closed = False
        self._failure: UpstreamFailed | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        # one parser for the connection's life: llhttp starts over after each answer, and
        # building one per answer cost 2-3% of the gateway's CPU
        self._parser = httptools.HttpResponseParser(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not derive from asyncio.Transport, so no isinstance check
        self.transport = cast(asyncio.Transport, transport)

    def send(self, data: bytes, response: UpstreamResponse) -> None:
        assert self.transport is not None
        self.response = response
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # nothing asked: a broken or confused peer
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamFailed("disconnect", f"malformed answer ({exc})"))
            self.close()
            return
        self._wake()
        if response.buffered > _PAUSE_BYTES:
            assert self.transport is not None
            self.transport.pause_reading()
            self._paused = True

    # httptools callbacks: they fill in the answer being read
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self._parser.get_status_code()
        headers = response.headers
        response.until_close = (
            "content-length" not in headers and "transfer-encoding" not in headers
        )

    def on_body(self, body: bytes) -> None:
        response = self.response
        assert response is not None
        response.body.append(body)
        response.buffered += len(body)

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        # asked here: after the callback the parser has moved on and answers False
        response.keep_alive = self._parser.should_keep_alive()
        response.complete = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None and not response.complete:
            if response.status and response.until_close:
                response.complete = True  # a body framed by the close
            else:
                self._fail(UpstreamFailed("disconnect", str(exc or "closed by the worker")))
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def wait(self, timeout_s: float | None = None, reason: str = "read_timeout") -> None:
        """Until more of the answer (or its end) arrived; fails with `reason` after
        `timeout_s` (default: the read timeout). Raises UpstreamFailed."""
        if self._failure is not None:
            raise self._failure
        if self._paused:
            assert self.transport is not None
            self._paused = False
            self.transport.resume_reading()
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        if timeout_s is None or timeout_s > self._read_timeout_s:
            timeout_s, reason = self._read_timeout_s, "read_timeout"
        timer = loop.call_later(timeout_s, self._timed_out, waiter, reason, timeout_s)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    @staticmethod
    def _timed_out(waiter: asyncio.Future[None], reason: str, timeout_s: float) -> None:
        if not waiter.done():
            waiter.set_exception(UpstreamFailed(reason, f"nothing for {timeout_s} s"))

    def _fail(self, failure: UpstreamFailed) -> None:
        self._failure = failure
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(failure)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class UpstreamResponse:
    """A worker's answer: `status` and `headers` (lower-case names) once `post` returned;
    the body through `read` or `read_chunk`; `release` when done with it."""

    __slots__ = (
        "_client",
        "_conn",
        "_key",
        "body",
        "buffered",
        "complete",
        "headers",
        "keep_alive",
        "status",
        "until_close",
    )

    def __init__(self, client: UpstreamClient, key: tuple[str, int], conn: _Connection) -> None:
        self._client = client
        self._key = key
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.buffered = 0
        """Bytes in `body`."""
        self.complete = False
        self.keep_alive = False
        self.until_close = False

    async def read(self) -> bytes:
        """The whole body. Raises UpstreamFailed."""
        while not self.complete:
            await self._conn.wait()
        return self._take()

    async def read_chunk(self) -> bytes:
        """The body bytes that arrived since the last call (waits for some); b"" at the end.
        Raises UpstreamFailed."""
        while not self.body and not self.complete:
            await self._conn.wait()
        return self._take()

    def _take(self) -> bytes:
        data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.buffered = 0
        return data

    async def _head(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while not self.status:
            await self._conn.wait(deadline - loop.time(), "first_byte_timeout")

    def release(self) -> None:
        """Give the connection back to the pool when the answer was read to its end and the
        worker keeps it alive; close it otherwise (cancelled, failed, cut short)."""
        conn = self._conn
        conn.response = None
        if self.complete and self.keep_alive and not self.body and not conn.closed:
            self._client.put_back(self._key, conn)
        else:
            conn.close()


class UpstreamClient:
    """POSTs to workers over pooled keep-alive connections."""

    def __init__(
        self, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float = 30.0
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def post(
        self, url: URL, headers: bytes, body: bytes, first_byte_timeout_s: float
    ) -> UpstreamResponse:
        """Send `body` to `url` and wait for the answer's status and headers: UpstreamFailed
        `first_byte_timeout` when they are not in within `first_byte_timeout_s` (the connect
        included). `headers`: the extra header lines, each ending in CRLF."""
        deadline = asyncio.get_running_loop().time() + first_byte_timeout_s
        host, port = url.raw_host or "", url.port or 80
        key = (host, port)
        conn = self._pooled(key) or await self._connect(key, first_byte_timeout_s)
        response = UpstreamResponse(self, key, conn)
        head = (
            f"POST {url.raw_path_qs} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Length: {len(body)}\r\n"
        ).encode("latin-1")
        try:
            conn.send(b"".join((head, headers, b"\r\n", body)), response)
            await response._head(deadline)
        except BaseException:
            conn.response = None
            conn.close()
            raise
        return response

    def put_back(self, key: tuple[str, int], conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(key, []).append(conn)

    def close(self) -> None:
        """Close every idle connection."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _pooled(self, key: tuple[str, int]) -> _Connection | None:
        conns = self._idle.get(key)
        expired_s = time.monotonic() - self._keepalive_s
        while conns:
            conn = conns.pop()  # the most recent: the likeliest to be open still
            if not conn.closed and conn.idle_since > expired_s:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int], first_byte_timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        timeout_s, reason = self._connect_timeout_s, "connect_timeout"
        if first_byte_timeout_s < timeout_s:
            timeout_s, reason = first_byte_timeout_s, "first_byte_timeout"
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self._read_timeout_s), *key
                )
        except TimeoutError:
            raise UpstreamFailed(reason, f"{key[0]}:{key[1]} within {timeout_s} s") from None
        except OSError as exc:
            raise UpstreamFailed("connect_error", f"{key[0]}:{key[1]}: {exc}") from None
        return conn
