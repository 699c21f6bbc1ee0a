"""The gateway's HTTP/1.1 client to its workers: keep-alive connections pooled per worker.

aiohttp's client session cost about a third of the gateway's CPU per proxied request (request
and response objects, payload writers, a timeout rescheduled on every read). This client does
what the proxy needs and no more: one write per request (head and body together), the answer
parsed by httptools (llhttp, as in Node.js) as it arrives, the body read whole or chunk by
chunk, and the connection back in the pool once the answer was read to its end.

Failures are UpstreamFailed with the reason the proxy records: `connect_error`,
`connect_timeout`, `read_timeout` (nothing for `read_timeout_s` while waiting for the answer)
and `disconnect` (the connection ended before the answer did, or the answer is not HTTP).
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
            response.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamFailed("disconnect", f"malformed answer ({exc})"))
            self.close()
            return
        self._wake()
        if response.buffered > _PAUSE_BYTES:
            assert self.transport is not None
            self.transport.pause_reading()
            self._paused = True

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

    async def wait(self) -> None:
        """Until more of the answer (or its end) arrived. Raises UpstreamFailed."""
        if self._failure is not None:
            raise self._failure
        if self._paused:
            assert self.transport is not None
            self._paused = False
            self.transport.resume_reading()
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(self._read_timeout_s, self._timed_out, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _timed_out(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(
                UpstreamFailed("read_timeout", f"nothing for {self._read_timeout_s} s")
            )

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
        "parser",
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
        self.parser = httptools.HttpResponseParser(self)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        headers = self.headers
        self.until_close = "content-length" not in headers and "transfer-encoding" not in headers

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        # asked here: after the callback the parser has moved on and answers False
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True

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

    async def _head(self) -> None:
        while not self.status:
            await self._conn.wait()

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

    async def post(self, url: URL, headers: bytes, body: bytes) -> UpstreamResponse:
        """Send `body` to `url` and wait for the answer's status and headers. `headers`: the
        extra header lines, each ending in CRLF. Raises UpstreamFailed."""
        host, port = url.raw_host or "", url.port or 80
        key = (host, port)
        conn = self._pooled(key) or await self._connect(key)
        response = UpstreamResponse(self, key, conn)
        head = (
            f"POST {url.raw_path_qs} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Length: {len(body)}\r\n"
        ).encode("latin-1")
        try:
            conn.send(b"".join((head, headers, b"\r\n", body)), response)
            await response._head()
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

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self._read_timeout_s), *key
                )
        except TimeoutError:
            raise UpstreamFailed(
                "connect_timeout", f"{key[0]}:{key[1]} within {self._connect_timeout_s} s"
            ) from None
        except OSError as exc:
            raise UpstreamFailed("connect_error", f"{key[0]}:{key[1]}: {exc}") from None
        return conn
