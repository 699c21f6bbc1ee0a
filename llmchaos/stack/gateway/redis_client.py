"""The token cache's Redis client: GET and SET with PX on one pipelined connection.

Why not redis-py: every request a gateway serves does one GET, and redis-py's asyncio client
spends more of the gateway's CPU on it (connection pool, retry wrapper, command objects)
than the rest of authentication. Redis answers the commands of a connection in order, so
one connection carries them all: each command appends a future to a queue, and replies
resolve the queue's head.

    client = RedisClient("redis://127.0.0.1:6379/0", password=None, connect_timeout_s=1.0)
    await client.get("token:abc")              # str, or None when the key is missing
    await client.set("token:abc", "t", px=300_000)
    await client.close()

Failures are OSError (ConnectionError: unreachable, closed; RedisReplyError: an error reply
such as NOAUTH): the caller falls back to SQLite, as for redis-py's errors. A command the
caller gave up on (its timeout) closes the connection, which fails what was waiting on it,
and the next command connects again: a Redis that stopped answering (moved, partitioned,
paused) is not waited on again. A reply of an unexpected kind closes it too.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import cast
from urllib.parse import urlsplit

__all__ = ["RedisClient", "RedisReplyError"]


class RedisReplyError(OSError):
    """Redis answered a command with an error (`-ERR ...`, `-NOAUTH ...`)."""


def _command(*parts: str) -> bytes:
    encoded = [p.encode() for p in parts]
    return b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in encoded)


class _Connection(asyncio.Protocol):
    """One connection: replies parsed as they come, resolving the waiting futures in order."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future[str | None]] = deque()
        self._buffer = b""
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def send(self, command: bytes) -> asyncio.Future[str | None]:
        """Write `command`; the future resolves with its reply."""
        assert self.transport is not None
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        self.transport.write(command)
        return future

    def close(self) -> None:
        """Close; the next command opens a new connection (what waits here fails)."""
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(ConnectionError(f"redis closed the connection ({exc})"))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        at = 0
        while self.waiting:
            parsed, at = self._reply(at)
            if parsed is None:
                break
            future = self.waiting.popleft()
            if isinstance(parsed, _Garbled):  # the order is lost: nothing after can be matched
                self._buffer = b""
                self.close()
                return
            if not future.done():  # not given up on
                if isinstance(parsed, RedisReplyError):
                    future.set_exception(parsed)
                else:
                    future.set_result(parsed)
        self._buffer = self._buffer[at:]
        if self._buffer and not self.waiting:
            self.close()  # a reply nobody asked for: the order is lost

    def _reply(self, at: int) -> tuple[str | RedisReplyError | None, int]:
        """The reply that starts at `at` of the buffer (a missing key's: _NIL) and where the
        next one starts; (None, at) when it has not all arrived."""
        buffer = self._buffer
        end = buffer.find(b"\r\n", at)
        if end < 0:
            return None, at
        kind, line = buffer[at : at + 1], buffer[at + 1 : end]
        if kind == b"$":
            size = int(line)
            if size < 0:
                return _NIL, end + 2
            if len(buffer) < end + 2 + size + 2:
                return None, at
            return buffer[end + 2 : end + 2 + size].decode(), end + 4 + size
        if kind == b"-":
            return RedisReplyError(line.decode(errors="replace")), end + 2
        if kind in (b"+", b":"):
            return line.decode(), end + 2
        return _Garbled(f"unexpected reply {kind!r}"), end + 2


class _Garbled(RedisReplyError):
    """A reply of a kind these commands never get: the connection can no longer be trusted."""


class _Nil(str):
    """A missing key's reply: told apart from an empty value (a cached negative entry)."""


_NIL = _Nil()


class RedisClient:
    """GET and SET PX over one pipelined connection to `url` (redis://host:port/db)."""

    def __init__(self, url: str, password: str | None, connect_timeout_s: float) -> None:
        parts = urlsplit(url)
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 6379
        self._db = int(parts.path.strip("/") or 0)
        self._password = password or parts.password
        self._connect_timeout_s = connect_timeout_s
        self._connection: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None

    async def get(self, key: str) -> str | None:
        """The value of `key`, None when it is missing. Raises OSError."""
        value = await self._send(_command("GET", key))
        return None if isinstance(value, _Nil) else value

    async def set(self, key: str, value: str, px: int) -> None:
        """Set `key` to `value` for `px` milliseconds. Raises OSError."""
        await self._send(_command("SET", key, value, "PX", str(px)))

    def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._connection is not None:
            self._connection.close()
        self._connection = None

    async def _send(self, command: bytes) -> str | None:
        connection = self._connection
        if connection is None or connection.lost:
            connection = await self._connect()
        try:
            return await connection.send(command)
        except asyncio.CancelledError:
            # given up on (the caller's timeout): a connection that stopped answering, to a
            # Redis that may be gone without a reset, is not waited on again
            connection.close()
            raise

    async def _connect(self) -> _Connection:
        # concurrent commands share one attempt
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._open())
        return await asyncio.shield(self._connecting)

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(_Connection, self._host, self._port)
        except TimeoutError:
            raise ConnectionError(
                f"redis {self._host}:{self._port}: no connection within {self._connect_timeout_s} s"
            ) from None
        futures = []
        if self._password:
            futures.append(connection.send(_command("AUTH", self._password)))
        if self._db:
            futures.append(connection.send(_command("SELECT", str(self._db))))
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                for future in futures:
                    await future
        except BaseException:
            connection.close()
            raise
        self._connection = connection
        return connection
