"""A lean Redis client for the token cache: GET and SET over one pipelined connection.

redis-py's asyncio client cost about a third of the gateway's CPU per request (a pool
checkout, a write and a stream-reader parse per command). Here the commands of one event-loop
turn go out in one write on one connection, and each reply answers the oldest command still
waiting (Redis answers a connection's commands in order). A cancelled command keeps its place,
so its late reply is read and dropped, never given to the next one. When the oldest command
has waited `timeout_s` the connection is stuck (a hung Redis, a partition): it is closed and
every command waiting on it fails with TimeoutError; one timer per connection checks that,
not a timeout scope per command (asyncio.timeout cost 2% of the gateway's CPU). The next
command connects again.

Errors: OSError (ConnectionError when the connection is lost) for the network, TimeoutError
for a connect or a reply slower than `timeout_s`, RedisReplyError for an error reply (-ERR,
-NOAUTH, -LOADING...).
"""

from __future__ import annotations

import asyncio
import collections
from typing import cast
from urllib.parse import unquote, urlsplit

from llmchaos.errors import InvalidInput

__all__ = ["RedisReplyError", "RespClient"]

_MAX_LINE_BYTES = 65536
"""A reply line longer than this is a broken peer, not Redis."""

Reply = bytes | int | None


class RedisReplyError(Exception):
    """Redis answered a command with an error reply."""


def _command(*args: bytes) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


class _RespProtocol(asyncio.Protocol):
    """One connection: writes commands, parses RESP2 replies, answers waiters in order."""

    def __init__(self, timeout_s: float) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: collections.deque[asyncio.Future[Reply]] = collections.deque()
        self._sent_at: collections.deque[float] = collections.deque()
        """Loop time each waiting command was sent, oldest first."""
        self._timeout_s = timeout_s
        self._watchdog: asyncio.TimerHandle | None = None
        self.lost = False
        self._buf = b""
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not derive from asyncio.Transport, so no isinstance check
        self.transport = cast(asyncio.Transport, transport)

    def send(self, command: bytes) -> asyncio.Future[Reply]:
        """Queue `command`; the commands of this loop turn are written together."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Reply] = loop.create_future()
        if not self._out:
            loop.call_soon(self._flush)
        self._out.append(command)
        self.waiting.append(future)
        self._sent_at.append(loop.time())
        if self._watchdog is None:
            self._watchdog = loop.call_later(self._timeout_s / 4, self._check_stuck)
        return future

    def _check_stuck(self) -> None:
        """Close the connection if its oldest command has waited `timeout_s`."""
        self._watchdog = None
        if not self._sent_at or self.lost:
            return
        loop = asyncio.get_running_loop()
        if loop.time() - self._sent_at[0] >= self._timeout_s:
            self.close(TimeoutError(f"redis: no reply within {self._timeout_s} s"))
            return
        self._watchdog = loop.call_later(self._timeout_s / 4, self._check_stuck)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.lost:
            self.transport.write(b"".join(out))

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        pos = 0
        try:
            while True:
                reply, end = self._parse(buf, pos)
                if end < 0:  # not all there yet
                    break
                pos = end
                if not self.waiting:
                    raise ValueError("a reply to no command")
                future = self.waiting.popleft()
                self._sent_at.popleft()
                if not future.done():  # a cancelled command's reply is dropped
                    if isinstance(reply, RedisReplyError):
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)
        except ValueError as exc:
            self.close(ConnectionError(f"redis: malformed reply ({exc})"))
            return
        self._buf = buf[pos:]

    @staticmethod
    def _parse(buf: bytes, pos: int) -> tuple[Reply | RedisReplyError, int]:
        """One reply from `buf` at `pos`: (reply, next position), or (None, -1) when it is
        not all there yet. Raises ValueError."""
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            if len(buf) - pos > _MAX_LINE_BYTES:
                raise ValueError("line too long")
            return None, -1
        kind, line = buf[pos : pos + 1], buf[pos + 1 : eol]
        if kind == b"+":
            return line, eol + 2
        if kind == b"-":
            return RedisReplyError(line.decode("utf-8", "replace")), eol + 2
        if not line.lstrip(b"-").isdigit():
            raise ValueError(f"{kind!r} with {line[:40]!r}")
        number = int(line)
        if kind == b":":
            return number, eol + 2
        if kind != b"$":
            raise ValueError(f"unexpected reply type {kind!r}")
        if number < 0:
            return None, eol + 2
        end = eol + 2 + number
        if len(buf) < end + 2:
            return None, -1
        if buf[end : end + 2] != b"\r\n":
            raise ValueError("bulk string not followed by CRLF")
        return buf[eol + 2 : end], end + 2

    def connection_lost(self, exc: Exception | None) -> None:
        self.close(ConnectionError(f"redis connection lost: {exc or 'closed by the peer'}"))

    def close(self, exc: Exception) -> None:
        """Fail every waiting command with `exc` and close the transport."""
        self.lost = True
        self._sent_at.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


class RespClient:
    """GET and SET on the Redis at `url` (redis://[[user]:password@]host[:port][/db])."""

    def __init__(self, url: str, password: str | None, timeout_s: float) -> None:
        """Raises InvalidInput for a URL that is not redis://."""
        parts = urlsplit(url)
        if parts.scheme != "redis" or not parts.hostname:
            raise InvalidInput(f"redis_url: expected redis://host:port/db, got {url!r}")
        self._host = parts.hostname
        self._port = parts.port or 6379
        db = parts.path.strip("/") or "0"
        if not db.isdigit():
            raise InvalidInput(f"redis_url: the database must be a number, got {db!r}")
        self._db = int(db)
        self._user = unquote(parts.username) if parts.username else None
        self._password = unquote(parts.password) if parts.password else password
        self._timeout_s = timeout_s
        self._protocol: _RespProtocol | None = None
        self._connecting: asyncio.Task[_RespProtocol] | None = None

    async def get(self, key: str) -> str | None:
        """The value of `key`, None when it has none."""
        reply = await self._call(_command(b"GET", key.encode()))
        return None if reply is None else bytes(reply).decode()

    async def set(self, key: str, value: str, px: int) -> None:
        """Set `key` to `value`, expiring in `px` milliseconds."""
        await self._call(_command(b"SET", key.encode(), value.encode(), b"PX", b"%d" % px))

    async def close(self) -> None:
        """Close the connection (and a connect in progress); the commands waiting on it fail
        with ConnectionError."""
        if self._connecting is not None:
            self._connecting.cancel()
        if self._protocol is not None:
            self._protocol.close(ConnectionError("redis client closed"))
            self._protocol = None

    async def _call(self, command: bytes) -> Reply:
        protocol = self._protocol
        if protocol is None or protocol.lost:
            if self._connecting is None:
                # a task of its own: one waiter's cancellation must not cancel the others'
                self._connecting = asyncio.ensure_future(self._connect())
                self._connecting.add_done_callback(self._connected)
            protocol = await asyncio.shield(self._connecting)
        return await protocol.send(command)

    def _connected(self, task: asyncio.Task[_RespProtocol]) -> None:
        self._connecting = None
        if not task.cancelled() and task.exception() is None:
            self._protocol = task.result()

    async def _connect(self) -> _RespProtocol:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._timeout_s):
            _, protocol = await loop.create_connection(
                lambda: _RespProtocol(self._timeout_s), self._host, self._port
            )
            try:
                handshake = []
                if self._password is not None:
                    credentials = [self._password.encode()]
                    if self._user is not None:
                        credentials.insert(0, self._user.encode())
                    handshake.append(protocol.send(_command(b"AUTH", *credentials)))
                if self._db:
                    handshake.append(protocol.send(_command(b"SELECT", b"%d" % self._db)))
                await asyncio.gather(*handshake)
            except BaseException:
                protocol.close(ConnectionError("redis handshake failed"))
                raise
        return protocol
