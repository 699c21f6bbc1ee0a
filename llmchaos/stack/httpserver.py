"""A lean HTTP/1.1 server for the engine workers and the gateways: an asyncio.Protocol on
uvloop with llhttp's parser (httptools), and nothing else between the socket and the handler.

Why: HTTP handling is most of a worker's and a gateway's CPU, and it bounds the rate one
machine can simulate. Side by side with aiohttp's server (2026-12-05, a busy box): a worker
0.096 vs 0.166 CPU-s per 1,000 short requests (bench/worker_throughput.py), a gateway 0.279
vs 0.367 (bench/gateway_throughput.py). What it does, as their clients (HAProxy, gateways,
LiteLLM's httpx, nginx, curl) need it: keep-alive (HTTP/1.1's default; HTTP/1.0 only when
asked), pipelined requests answered in order, `Expect: 100-continue`, bodies framed by
Content-Length or chunked up to `max_body_bytes` (413 above it), answers framed by
Content-Length or, streamed, chunked (HTTP/1.0: until the connection closes), writes that
wait for a slow reader, idle connections closed after `keepalive_s`, and the handler
cancelled when its client goes away (as vLLM's `with_cancellation`). Malformed HTTP gets
`on_error`'s answer to a 400, after the answers to the requests before it, and the
connection closes.

    server = HttpServer({"/healthz": {"GET": healthz}}, on_error, headers=[("X-Worker", "w")])
    port = await server.start("127.0.0.1", 0)
    ...
    server.close()                      # stop accepting
    await server.wait_closed(grace_s)   # in-flight handlers get grace_s, then are cut

A handler takes the Request and a Responder and returns a Response, or streams through the
Responder (`await start(...)`, `await write(data)`, `await end()`) and returns None.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

import httptools

__all__ = [
    "Handler",
    "HttpError",
    "HttpServer",
    "Request",
    "Responder",
    "Response",
    "header_line",
]

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 65536
"""A request line and headers longer than this are refused (no client of a worker sends that)."""
_MAX_QUEUED = 8
"""Pipelined requests parsed ahead of the one being served before reading pauses."""
_LINGER_S = 2.0
_LINGER_BYTES = 4 << 20
"""After an error answer that ends a connection, what the client still sends is read and
dropped for this long (or this much): closing at once would reset the connection and the
client would never read the 413 or 400, as aiohttp's lingering close avoids."""


class HttpError(Exception):
    """An error the server answers itself: no such route (404), wrong method (405, `allow`
    the methods there are), a body over the limit (413), malformed HTTP (400)."""

    def __init__(self, status: int, reason: str, allow: str | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.allow = allow


@dataclass(slots=True)
class Request:
    """One parsed request. Header names are lower case; a repeated header keeps its last
    value."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    http_11: bool
    transport: asyncio.Transport
    """For a handler that must cut its answer short, as a failing engine would."""
    answer_headers: Sequence[tuple[str, str]] = ()
    """Set by a handler: they go on whatever answers this request, streamed, plain or an
    error (the gateway's X-Degraded)."""


@dataclass(slots=True)
class Response:
    """A whole answer: its status, body and headers (Content-Length is added)."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: Iterable[tuple[str, str]] = ()


Handler = Callable[[Request, "Responder"], Awaitable[Response | None]]
ErrorHandler = Callable[[BaseException, Request | None], Response]
"""The answer to an exception a handler raised, or to an HttpError (request None when the
request could not be parsed)."""


def header_line(name: str, value: str) -> bytes:
    """One header line; a line break in a value cannot start a header of its own, and what
    latin-1 cannot carry becomes "?"."""
    if "\r" in value or "\n" in value:
        value = value.replace("\r", " ").replace("\n", " ")
    return f"{name}: {value}\r\n".encode("latin-1", "replace")


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


_STATUS_LINES = {status.value: _status_line(status.value) for status in HTTPStatus}


class Responder:
    """A streamed answer to one request: `start`, `write` as often as needed, `end`."""

    __slots__ = ("_chunked", "_conn", "_request", "ended", "started")

    def __init__(self, conn: _Connection, request: Request) -> None:
        self._conn = conn
        self._request = request
        self._chunked = request.http_11
        self.started = False
        self.ended = False

    async def start(self, status: int = 200, headers: Iterable[tuple[str, str]] = ()) -> None:
        """Send the status line and headers. Raises ConnectionResetError when the client is
        gone."""
        framing = [("Transfer-Encoding", "chunked")] if self._chunked else []
        if not self._chunked:
            self._request.keep_alive = False  # HTTP/1.0: the body ends with the connection
        self.started = True
        await self._conn.send(self._conn.head(status, [*headers, *framing], self._request, None))

    async def write(self, data: bytes) -> None:
        """Send `data` (nothing for b""); waits while the client reads slowly. Raises
        ConnectionResetError when the client is gone."""
        if data:
            await self._conn.send(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)

    async def end(self) -> None:
        """The answer is complete."""
        self.ended = True
        if self._chunked:
            await self._conn.send(b"0\r\n\r\n")


class _Connection(asyncio.Protocol):
    """One client connection: parses requests as bytes arrive and serves them in order."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._remote = ""
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._error: HttpError | None = None
        self._broken: HttpError | None = None
        """A request that could not be parsed, answered once those before it are."""
        self._lingering = False
        self._lingered_bytes = 0
        self._reading = True
        self._writable: asyncio.Future[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._idle_until: float | None = None
        """loop.time() after which an idle connection closes; None while a request is served.
        The one timer checks it when it fires rather than being moved per request."""

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike
        self._transport = cast(asyncio.Transport, transport)
        peer = self._transport.get_extra_info("peername")
        self._remote = str(peer[0]) if isinstance(peer, tuple) else str(peer or "")
        self._server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        if self._task is not None:
            self._task.cancel()  # the client went away: its handler stops (and aborts its work)
        self._queue.clear()
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingered_bytes += len(data)
            if self._lingered_bytes > _LINGER_BYTES:
                self.close()
            return
        try:
            self._parser.feed_data(data)
        except Exception as exc:  # httptools' errors, or ours raised from a callback
            error = self._error or HttpError(400, " ".join(str(exc).split())[:200])
            self._fail(error)

    # httptools callbacks

    def on_message_begin(self) -> None:
        # a request must arrive whole within keepalive_s of its first byte, as an idle
        # connection must send one: a stalled head or body does not hold the connection
        self._arm_idle()
        self._error = None
        self._url = b""
        self._headers = {}
        self._head_bytes = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._server.max_body_bytes:
            self._raise(HttpError(413, "request body over the limit"))
        expects = self._headers.get("expect", "").lower() == "100-continue"
        # not in the middle of another answer: the client sends its body after a pause anyway
        if expects and self._transport and self._task is None and not self._queue:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._server.max_body_bytes:
            self._raise(HttpError(413, "request body over the limit"))
        self._body.append(body)

    def on_message_complete(self) -> None:
        assert self._transport is not None
        self._idle_until = None
        try:
            url = httptools.parse_url(self._url)
        except httptools.HttpParserInvalidURLError:
            self._raise(HttpError(400, f"invalid URL {self._url[:100]!r}"))
        request = Request(
            method=self._parser.get_method().decode("ascii"),
            path=(url.path or b"/").decode("latin-1"),
            query=(url.query or b"").decode("latin-1"),
            headers=self._headers,
            body=b"".join(self._body),
            keep_alive=self._parser.should_keep_alive(),
            http_11=self._parser.get_http_version() == "1.1",
            transport=self._transport,
        )
        self._queue.append(request)
        if self._task is None:
            self._serve_next()
        elif len(self._queue) >= _MAX_QUEUED and self._reading:
            self._reading = False
            self._transport.pause_reading()

    # serving

    def _serve_next(self) -> None:
        request = self._queue.popleft()
        self._task = asyncio.get_running_loop().create_task(self._serve(request))
        if not self._reading and self._broken is None and self._transport is not None:
            self._reading = True
            self._transport.resume_reading()

    async def _serve(self, request: Request) -> None:
        responder = Responder(self, request)
        try:
            try:
                response = await self._server.dispatch(request, responder)
            except (asyncio.CancelledError, ConnectionResetError):
                raise
            except Exception as exc:
                if responder.started:  # a stream failed half way: the client must see it cut
                    log.exception("error in the stream of %s %s", request.method, request.path)
                    self.close()
                    return
                response = self._server.on_error(exc, request)
            if responder.started:
                if not responder.ended:
                    self.close()
                    return
            elif response is not None:
                head = self.head(response.status, response.headers, request, response)
                await self.send(head, b"" if request.method == "HEAD" else response.body)
        except (asyncio.CancelledError, ConnectionResetError):
            self.close()
            return
        except Exception:  # ours, not the handler's: the connection cannot go on
            log.exception("error answering %s %s", request.method, request.path)
            self.close()
            return
        self._task = None
        if not request.keep_alive or self._server.stopping:
            self.close()
        elif self._queue:
            self._serve_next()
        elif self._broken is not None:
            self._answer_broken()
        else:
            self._arm_idle()

    def head(
        self,
        status: int,
        headers: Iterable[tuple[str, str]],
        request: Request | None,
        response: Response | None,
    ) -> bytes:
        """The status line and headers: the server's, the answer's, its framing (for
        `request`; None: the connection closes after it)."""
        lines = [_STATUS_LINES.get(status) or _status_line(status), self._server.header_block]
        if response is not None:
            lines.append(
                header_line("Content-Type", response.content_type)
                + b"Content-Length: %d\r\n" % len(response.body)
            )
        lines += [header_line(name, value) for name, value in headers]
        if request is not None:
            lines += [header_line(name, value) for name, value in request.answer_headers]
        if request is None or not request.keep_alive or self._server.stopping:
            lines.append(b"Connection: close\r\n")
        elif not request.http_11:
            lines.append(b"Connection: keep-alive\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def send(self, data: bytes, body: bytes = b"") -> None:
        """Write `data` and `body`; wait while the transport's buffer is full. Raises
        ConnectionResetError when the connection is closed."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(data + body if body else data)
        if self._writable is not None and not self._writable.done():
            await self._writable

    def close(self) -> None:
        """Close the connection (a handler still running is cancelled by connection_lost)."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _fail(self, error: HttpError) -> None:
        """A request could not be parsed: nothing after it on the connection can be framed.
        Its answer follows the answers to the requests before it, then the connection
        closes."""
        if error.status == 400:
            log.warning("malformed HTTP request from %s: %s", self._remote, error.reason)
        self._broken = error
        if self._transport is not None:
            self._transport.pause_reading()
        if self._task is None:
            self._answer_broken()

    def _answer_broken(self) -> None:
        """Answer the request that could not be parsed, then linger: read and drop what the
        client still sends for a while before closing, so it gets to read the answer."""
        assert self._broken is not None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        response = self._server.on_error(self._broken, None)
        transport.write(self.head(response.status, response.headers, None, response))
        transport.write(response.body)
        if transport.can_write_eof():
            transport.write_eof()
        self._lingering = True
        transport.resume_reading()
        asyncio.get_running_loop().call_later(_LINGER_S, self.close)

    def _raise(self, error: HttpError) -> None:
        self._error = error
        raise error

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            self._raise(HttpError(400, f"request line and headers over {MAX_HEAD_BYTES} bytes"))

    def _arm_idle(self) -> None:
        loop = asyncio.get_running_loop()
        self._idle_until = loop.time() + self._server.keepalive_s
        if self._idle is None:
            self._idle = loop.call_at(self._idle_until, self._on_idle)

    def _on_idle(self) -> None:
        self._idle = None
        until = self._idle_until
        if until is None:
            return  # serving: _arm_idle starts the timer again when the answer is out
        loop = asyncio.get_running_loop()
        if until <= loop.time():
            self.close()
        else:
            self._idle = loop.call_at(until, self._on_idle)


class HttpServer:
    """Serves `routes` ({path: {method: handler}}; a GET route answers HEAD too)."""

    def __init__(
        self,
        routes: Mapping[str, Mapping[str, Handler]],
        on_error: ErrorHandler,
        headers: Iterable[tuple[str, str]] = (),
        max_body_bytes: int = 1 << 20,
        keepalive_s: float = 75.0,
    ) -> None:
        self.routes = {path: dict(methods) for path, methods in routes.items()}
        for methods in self.routes.values():
            if "GET" in methods:
                methods.setdefault("HEAD", methods["GET"])
        self.on_error = on_error
        self.header_block = b"".join(header_line(name, value) for name, value in headers)
        self.max_body_bytes = max_body_bytes
        self.keepalive_s = keepalive_s
        self.connections: set[_Connection] = set()
        self.stopping = False
        """Set by close(): answers say `Connection: close`, then their connections close."""
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int, backlog: int = 1024) -> int:
        """Listen; returns the bound port. Raises OSError when the address cannot be bound."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def dispatch(self, request: Request, responder: Responder) -> Response | None:
        methods = self.routes.get(request.path)
        if methods is None:
            raise HttpError(404, "Not Found")
        handler = methods.get(request.method)
        if handler is None:
            raise HttpError(405, "Method Not Allowed", allow=",".join(sorted(methods)))
        return await handler(request, responder)

    def close(self) -> None:
        """Stop accepting connections; close the idle ones, and the busy ones after their
        current answer."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn._task is None:
                conn.close()

    async def wait_answered(self, timeout_s: float, hurry: asyncio.Event | None = None) -> None:
        """Wait up to `timeout_s` (less once `hurry` is set) for the handlers still running to
        answer, cutting nothing: a drain, after close()."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        hurried = loop.create_task(hurry.wait()) if hurry is not None else None
        try:
            while True:
                running = {c._task for c in self.connections if c._task is not None}
                left_s = deadline - loop.time()
                if not running or left_s <= 0 or (hurried is not None and hurried.done()):
                    return
                waiters: set[asyncio.Future[Any]] = {*running, *([hurried] if hurried else [])}
                await asyncio.wait(waiters, timeout=left_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if hurried is not None:
                hurried.cancel()

    async def wait_closed(self, grace_s: float) -> None:
        """Give the handlers still running `grace_s`, then cut their connections (which
        cancels them) and let them end."""
        running = [c._task for c in self.connections if c._task is not None]
        if running:
            _, late = await asyncio.wait(running, timeout=grace_s)
            for conn in list(self.connections):
                conn.close()
            if late:
                await asyncio.wait(late, timeout=1.0)
        for conn in list(self.connections):
            conn.close()
