"""The gateways' HTTP/1.1 client to their workers: keep-alive connections per worker and
llhttp's response parser (httptools), for the one request a proxied request makes.

    pool = UpstreamPool(connect_timeout_s=1.0, read_timeout_s=30.0)
    response = await pool.post(url, body, headers)   # once the status line and headers are in
    response.status, response.headers["x-worker"]
    await response.read()          # the whole body;  or:  await response.readany()  (b"": end)
    response.release()             # back to the pool when read to the end, else closed
    await pool.close()

Why not aiohttp's session: its request path (request and response objects, payload writers,
timer handles, the connector's bookkeeping) cost the gateway more CPU than the rest of the
proxying. Failures are UpstreamError subclasses whose `reason` is the proxy's failure class:
connect_error, connect_timeout, read_timeout (nothing for `read_timeout_s`), disconnect (the
connection ended, or sent what is not HTTP, before the answer's end). The health checks and
the engines' /metrics reads stay on aiohttp's session: a few a second.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import cast

import httptools
from yarl import URL

from llmchaos.stack.httpserver import header_line

__all__ = ["UpstreamError", "UpstreamPool", "UpstreamResponse"]

_MAX_CHUNKS = 64
"""Pieces of an answer held before reading from the worker pauses."""


class UpstreamError(Exception):
    """A request to a worker failed; `reason` is its failure class."""

    reason = "disconnect"


class _ConnectError(UpstreamError):
    reason = "connect_error"


class _ConnectTimeout(UpstreamError):
    reason = "connect_timeout"


class _ReadTimeout(UpstreamError):
    reason = "read_timeout"


class _Connection(asyncio.Protocol):
    """One keep-alive connection, one answer at a time."""

    def __init__(self, key: tuple[str, int], on_lost: Callable[[_Connection], None]) -> None:
        self.key = key
        """(host, port) as the pool knows it."""
        self._on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.expecting = False
        """An answer is due: bytes at any other time mean the connection is not ours to trust."""
        self.idle_since_s = 0.0
        self._head: asyncio.Future[None] | None = None
        self._headers: dict[str, str] = {}
        self._chunks: deque[bytes] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.complete = False
        self.keep_alive = False
        self._paused = False
        self._error: UpstreamError | None = None

    def begin(self) -> asyncio.Future[None]:
        """Expect a new answer; the future resolves when its headers are in."""
        self._head = asyncio.get_running_loop().create_future()
        self._headers = {}
        self._chunks.clear()
        self.complete = False
        self.expecting = True
        return self._head

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.complete:
            self._fail(UpstreamError(f"the worker closed the connection ({exc})"))
        self._on_lost(self)

    def data_received(self, data: bytes) -> None:
        if not self.expecting:
            self.close()  # an answer nobody asked for (late, or to another request)
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"not an HTTP answer: {exc}"))
            self.close()

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.status < 200:  # 100 Continue and the like: the answer is still to come
            return
        self.keep_alive = self._parser.should_keep_alive()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        if len(self._chunks) > _MAX_CHUNKS and not self._paused and self.transport is not None:
            self._paused = True  # the client reads slower than the worker writes
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status < 200:
            self._headers = {}
            return
        self.complete = True
        self._wake()

    # reading

    @property
    def status(self) -> int:
        return int(self._parser.get_status_code())

    @property
    def headers(self) -> dict[str, str]:
        return self._headers

    async def next_chunk(self, timeout_s: float) -> bytes:
        """The next piece of the body, b"" at its end. Raises UpstreamError."""
        if self._paused and len(self._chunks) <= _MAX_CHUNKS // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        while not self._chunks:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._waiter
            except TimeoutError:
                raise _ReadTimeout(f"nothing from the worker for {timeout_s} s") from None
        return self._chunks.popleft()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._wake()


class UpstreamResponse:
    """A worker's answer: its status and headers (lower-case names) are in; the body is
    read with `read` or `readany`."""

    __slots__ = ("_conn", "_pool", "_read_timeout_s", "_released", "headers", "status")

    def __init__(self, pool: UpstreamPool, conn: _Connection, read_timeout_s: float) -> None:
        self._pool = pool
        self._conn = conn
        self._read_timeout_s = read_timeout_s
        self._released = False
        self.status = conn.status
        self.headers = conn.headers

    async def readany(self) -> bytes:
        """The next piece of the body; b"" at its end. Raises UpstreamError."""
        return await self._conn.next_chunk(self._read_timeout_s)

    async def read(self) -> bytes:
        """The rest of the body. Raises UpstreamError."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if the body was read to
        the end and the worker keeps it alive; else it closes. Idempotent."""
        if not self._released:
            self._released = True
            self._pool.give_back(self._conn)


class UpstreamPool:
    """Keep-alive connections to the workers, by host and port."""

    def __init__(
        self, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float = 30.0
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._keepalive_s = keepalive_s
        """An idle connection older than this is closed rather than reused (the workers keep
        theirs for 75 s, so the gateway never sends on one the worker is closing)."""
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()

    async def post(self, url: URL, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """POST `body` to `url`; returns once the answer's status and headers are in.
        Raises UpstreamError."""
        host, port = url.host or "127.0.0.1", url.port or 80
        conn = await self._acquire(host, port)
        head = conn.begin()
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        request = [f"POST {url.raw_path_qs} HTTP/1.1\r\nHost: {authority}\r\n".encode()]
        # a value latin-1 cannot carry (a tenant's name) is replaced, not a 500
        request += [header_line(name, value) for name, value in headers.items()]
        request.append(b"Content-Length: %d\r\n\r\n" % len(body))
        assert conn.transport is not None
        try:
            conn.transport.write(b"".join(request) + body)
            async with asyncio.timeout(self._read_timeout_s):
                await head
        except BaseException as exc:
            self._drop(conn)  # cancelled (a hedge lost) or failed: the answer would come unread
            if isinstance(exc, TimeoutError):
                raise _ReadTimeout(
                    f"no answer from {host}:{port} within {self._read_timeout_s} s"
                ) from None
            raise
        return UpstreamResponse(self, conn, self._read_timeout_s)

    def give_back(self, conn: _Connection) -> None:
        if conn.lost or not conn.complete or not conn.keep_alive:
            self._drop(conn)
            return
        conn.expecting = False
        conn.idle_since_s = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    def close(self) -> None:
        """Close every connection."""
        for conn in self._open:
            conn.close()
        self._open.clear()
        self._idle.clear()

    async def _acquire(self, host: str, port: int) -> _Connection:
        idle = self._idle.get((host, port))
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since_s < self._keepalive_s:
                return conn
            self._drop(conn)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection((host, port), self._forget), host, port
                )
        except TimeoutError:
            raise _ConnectTimeout(
                f"no connection to {host}:{port} within {self._connect_timeout_s} s"
            ) from None
        except OSError as exc:
            raise _ConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        self._open.add(conn)
        return conn

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._open.discard(conn)

    def _forget(self, conn: _Connection) -> None:
        """A connection ended: no longer open, nor idle (the worker may be gone for good)."""
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle is not None and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]
