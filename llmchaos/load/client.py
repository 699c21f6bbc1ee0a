"""Keep-alive HTTP/1.1 connections on raw non-blocking sockets, driven by the gevent loop.

Why not a greenlet per request on gevent's sockets (geventhttpclient, as before): each request
then cost a greenlet, four switches between it and the hub, a gevent.Timeout, a liveness check
of the pooled connection, a recv that only said EAGAIN, an epoll change to wait, and gevent's
Python socket wrappers around every call. Here the caller's greenlet sends a request with one
send() on the raw socket; the answer is read in the callback of the connection's read watcher
(started once per connection, so waiting costs no epoll change) and parsed incrementally
(http1.ResponseParser); one timer sweeps the requests, in send order, for timeouts. Nothing
here blocks or switches greenlets.

A connection is reused only after a complete answer that allows it; one that timed out, broke
or answered badly is closed, never reused. An idle connection that becomes readable was closed
by the server (or sent junk) and is closed too.

Imports gevent: only Locust processes import this module (via user.py).
"""

from __future__ import annotations

import _socket
import contextlib
import errno
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import gevent
import gevent.socket

from llmchaos.load.http1 import BadResponse, NoResponse, ResponseParser
from llmchaos.load.responses import Answer, SseReader, classify
from llmchaos.load.stamps import ANCILLARY_BYTES, SO_TIMESTAMPNS, receive_time

__all__ = ["Client", "Exchange"]

logger = logging.getLogger(__name__)

_READ, _WRITE = 1, 2  # libev/libuv event bits
_RECV_BYTES = 65536
SWEEP_S = 0.01
"""Period of the timeout sweep: a request times out between timeout_s and this much later."""
_CONNECTING = (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN)


class Exchange:
    """One request: what the load records about it, and its parser while it runs."""

    __slots__ = ("conn", "deadline", "done", "due", "parser", "sec", "sse", "tenant")

    def __init__(self, sec: int, due: float, tenant: str, stream: bool) -> None:
        self.sec = sec
        self.due = due
        self.tenant = tenant
        self.sse = SseReader() if stream else None
        self.parser = ResponseParser(self.sse)
        self.conn: _Conn | None = None
        self.deadline = 0.0
        self.done = False


Done = Callable[[Exchange, Answer, "str | None", float], None]
"""on_done(exchange, answer, serving mode, monotonic end time)."""


class Client:
    """Sends requests to one host:port and reports each outcome once through `on_done`."""

    def __init__(self, host: str, port: int, timeout_s: float, on_done: Done) -> None:
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self.on_done = on_done
        self.loop: Any = gevent.get_hub().loop
        self._addr: tuple[int, Any] | None = None
        self._idle: list[_Conn] = []  # a stack: the most recently used connection first
        self._conns: set[_Conn] = set()
        self._pending: deque[Exchange] = deque()  # in send order, so in deadline order
        self._sweeper: Any = self.loop.timer(SWEEP_S, SWEEP_S)
        self._sweeper.start(self._sweep)

    def request(self, data: bytes, ex: Exchange) -> None:
        """Send `data` (a whole HTTP request) for `ex`. Never raises: a failure to connect or
        send is reported through on_done before this returns."""
        ex.deadline = time.monotonic() + self.timeout_s
        self._pending.append(ex)
        conn = None
        try:
            conn = self._take_idle() or self._connect()
            conn.start(ex, data)
        except OSError:
            self.fail(ex, "connection")
        except Exception:
            logger.exception("unexpected error while sending a request")
            self.fail(ex, "connection")

    def complete(self, ex: Exchange, reusable: bool, now: float) -> None:
        ex.done = True
        conn = ex.conn
        if conn is not None:
            conn.exchange = None
            if reusable:
                self._idle.append(conn)
            else:
                self.discard(conn)
        parser = ex.parser
        if ex.sse is not None and parser.status == 200:
            answer = ex.sse.result(ex.due, now)
        else:
            answer = classify(parser.status, parser.body())
        self.on_done(ex, answer, parser.mode, now)

    def fail(self, ex: Exchange, outcome: str) -> None:
        """End `ex` with a failure class; its connection is closed, never reused."""
        if ex.done:
            return
        ex.done = True
        conn = ex.conn
        if conn is not None:
            conn.exchange = None
            self.discard(conn)
        self.on_done(ex, Answer(outcome), None, time.monotonic())

    def discard(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True  # an idle one stays in the stack until popped, then is skipped
        conn.reader.stop()
        conn.reader.close()
        conn.writer.stop()
        conn.writer.close()
        conn.sock.close()
        self._conns.discard(conn)

    def close(self) -> None:
        """Stop the sweep and close every connection. Requests still running are not
        reported: they stay in flight in the accounting."""
        self._sweeper.stop()
        self._sweeper.close()
        for conn in list(self._conns):
            self.discard(conn)
        self._idle.clear()
        self._pending.clear()

    def _take_idle(self) -> _Conn | None:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    def _connect(self) -> _Conn:
        if self._addr is None:
            # gevent's resolver, once (again after a failure); a failure is a connection error.
            info = gevent.socket.getaddrinfo(self.host, self.port, 0, _socket.SOCK_STREAM)
            self._addr = (info[0][0], info[0][4])
        family, addr = self._addr
        sock = _socket.socket(family, _socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            # chunk times are when the kernel got them, not when this process got to read
            # them (scheduled late on a busy machine); not Linux: read times
            with contextlib.suppress(OSError):
                sock.setsockopt(_socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            err = sock.connect_ex(addr)
            if err and err not in _CONNECTING:
                raise OSError(err, os.strerror(err))
            conn = _Conn(self, sock, connecting=bool(err))
        except BaseException:
            sock.close()
            raise
        self._conns.add(conn)
        return conn

    def _sweep(self) -> None:
        try:
            pending = self._pending
            now = time.monotonic()
            while pending:
                ex = pending[0]
                if not ex.done and ex.deadline > now:
                    break
                pending.popleft()
                if not ex.done:
                    self.fail(ex, "timeout")
        except Exception:
            logger.exception("unexpected error in the timeout sweep")


class _Conn:
    """One socket, at most one exchange at a time."""

    __slots__ = ("client", "closed", "connecting", "exchange", "out", "reader", "sock", "writer")

    def __init__(self, client: Client, sock: _socket.socket, connecting: bool) -> None:
        self.client = client
        self.sock = sock
        self.connecting = connecting
        self.closed = False
        self.exchange: Exchange | None = None
        self.out: memoryview | None = None  # request bytes the socket did not take yet
        fd = sock.fileno()
        self.reader: Any = client.loop.io(fd, _READ)
        self.writer: Any = client.loop.io(fd, _WRITE)
        # Always watched, idle or not: an idle connection that turns readable was closed.
        self.reader.start(self._on_readable)

    def start(self, ex: Exchange, data: bytes) -> None:
        """Send `ex`'s request; what the socket does not take now goes when it is writable.
        Raises OSError."""
        self.exchange = ex
        ex.conn = self
        sent = 0
        if not self.connecting:
            with contextlib.suppress(BlockingIOError):  # full buffer: the writer sends it
                sent = self.sock.send(data)
        if sent < len(data):
            self.out = memoryview(data)[sent:]
            self.writer.start(self._on_writable)

    def _on_writable(self) -> None:
        ex = self.exchange
        out = self.out
        if ex is None or out is None:
            self.writer.stop()
            return
        try:
            if self.connecting:
                err = self.sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_ERROR)
                if err:
                    raise OSError(err, os.strerror(err))
                self.connecting = False
            try:
                sent = self.sock.send(out)
            except BlockingIOError:
                return
            if sent < len(out):
                self.out = out[sent:]
            else:
                self.out = None
                self.writer.stop()
        except OSError:
            self.client.fail(ex, "connection")
        except Exception:
            logger.exception("unexpected error while sending a request")
            self.client.fail(ex, "connection")

    def _on_readable(self) -> None:
        ex = self.exchange
        client = self.client
        try:
            data, ancillary, _, _ = self.sock.recvmsg(_RECV_BYTES, ANCILLARY_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            if ex is None:
                client.discard(self)
            else:
                client.fail(ex, "connection")
            return
        if ex is None:
            client.discard(self)  # idle: closed by the server, or junk; never reuse it
            return
        try:
            parser = ex.parser
            now = receive_time(ancillary) or time.monotonic()
            if not (parser.feed(data, now) if data else parser.eof()):
                return
            reusable = bool(data) and parser.keep_alive and not parser.trailing and not self.out
            client.complete(ex, reusable, now)
        except BadResponse:
            client.fail(ex, "bad_body")
        except NoResponse:
            client.fail(ex, "connection")
        except Exception:
            logger.exception("unexpected error while reading an answer")
            client.fail(ex, "connection")
