"""The gateway's lean Redis client (resp.py): against redis-server, and a scripted peer.

The scripted-peer tests run on uvloop, as the gateway does (its transports are not
asyncio.Transport subclasses).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from llmchaos.errors import InvalidInput
from llmchaos.stack.gateway.resp import RedisReplyError, RespClient
from tests.stack import gateway_fixtures as fx
from tests.stack.gateway_fixtures import RedisServer

redis_server = fx.redis_server

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _run(script: Script, test: Callable[[RespClient], Coroutine[Any, Any, None]]) -> None:
    """Run `test` on uvloop with a client of a peer that serves each connection by `script`."""

    async def main() -> None:
        server = await asyncio.start_server(script, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RespClient(f"redis://127.0.0.1:{port}/0", None, timeout_s=1.0)
        try:
            await asyncio.wait_for(test(client), 5.0)
        finally:
            await client.close()
            server.close()

    uvloop.run(main())


async def _commands(reader: asyncio.StreamReader, count: int) -> list[list[bytes]]:
    """Read `count` RESP commands (arrays of bulk strings)."""
    commands = []
    for _ in range(count):
        size = int((await reader.readline())[1:])
        args = []
        for _ in range(size):
            length = int((await reader.readline())[1:])
            args.append((await reader.readexactly(length + 2))[:-2])
        commands.append(args)
    return commands


@pytest.mark.asyncio
async def test_get_and_set_against_redis(redis_server: RedisServer) -> None:
    client = RespClient(redis_server.url, None, timeout_s=1.0)
    try:
        assert await client.get("token:absent") is None
        await client.set("token:a", "tenant-a", px=5000)
        await client.set("token:neg", "", px=5000)
        assert await client.get("token:a") == "tenant-a"
        assert await client.get("token:neg") == ""
        assert 4000 < redis_server.client.pttl("token:a") <= 5000
        for i in range(50):
            redis_server.client.set(f"k{i}", f"value-{i}" * i)
        values = await asyncio.gather(*(client.get(f"k{i}") for i in range(50)))
        assert values == [f"value-{i}" * i for i in range(50)]
    finally:
        await client.close()


def test_the_commands_of_one_turn_go_out_in_one_write() -> None:
    reads: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reads.append(await reader.read(65536))
        writer.write(b"".join(b"$1\r\n%d\r\n" % i for i in range(10)))
        await writer.drain()
        await reader.read()

    async def test(client: RespClient) -> None:
        values = await asyncio.gather(*(client.get(f"k{i}") for i in range(10)))
        assert values == [str(i) for i in range(10)]

    _run(script, test)
    assert reads[0].count(b"GET") == 10


def test_a_cancelled_commands_late_reply_is_not_given_to_the_next() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _commands(reader, 2)
        writer.write(b"$4\r\nlate\r\n$5\r\nright\r\n")
        await writer.drain()
        await reader.read()

    async def test(client: RespClient) -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.get("slow"), 0.05)
        assert await client.get("next") == "right"

    _run(script, test)


def test_error_reply_fails_its_command_only() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _commands(reader, 2)
        writer.write(b"-LOADING Redis is loading the dataset\r\n+OK\r\n")
        await writer.drain()
        await reader.read()

    async def test(client: RespClient) -> None:
        results = await asyncio.gather(
            client.get("a"), client.set("b", "v", px=10), return_exceptions=True
        )
        assert isinstance(results[0], RedisReplyError)
        assert "LOADING" in str(results[0])
        assert results[1] is None

    _run(script, test)


@pytest.mark.parametrize(
    "reply",
    [b"$5\r\nab", b"?what\r\n", b"$x\r\n", b"$2\r\nabcd\r\n"],
    ids=["cut-mid-reply", "unknown-type", "bad-length", "no-crlf-after-bulk"],
)
def test_a_broken_peer_fails_the_waiting_commands_and_the_next_reconnects(reply: bytes) -> None:
    connections = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        if connections == 1:
            await _commands(reader, 2)
            writer.write(reply)
            await writer.drain()
            writer.close()  # the cut-mid-reply case: the peer goes away
            return
        await _commands(reader, 1)
        writer.write(b"$2\r\nok\r\n")
        await writer.drain()
        await reader.read()

    async def test(client: RespClient) -> None:
        results = await asyncio.gather(client.get("a"), client.get("b"), return_exceptions=True)
        assert all(isinstance(r, ConnectionError) for r in results), results
        assert await client.get("c") == "ok"

    _run(script, test)
    assert connections == 2


def test_password_and_database_are_sent_first() -> None:
    seen: list[list[bytes]] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.extend(await _commands(reader, 2))
        writer.write(b"+OK\r\n+OK\r\n")
        seen.extend(await _commands(reader, 1))
        writer.write(b"$-1\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        server = await asyncio.start_server(script, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RespClient(f"redis://127.0.0.1:{port}/3", "s3cret", timeout_s=1.0)
        try:
            assert await asyncio.wait_for(client.get("k"), 5.0) is None
        finally:
            await client.close()
            server.close()

    uvloop.run(main())
    assert seen == [[b"AUTH", b"s3cret"], [b"SELECT", b"3"], [b"GET", b"k"]]


def test_close_fails_the_waiting_commands() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async def test(client: RespClient) -> None:
        waiting = asyncio.ensure_future(client.get("a"))
        await asyncio.sleep(0.05)
        await client.close()
        with pytest.raises(ConnectionError):
            await waiting

    _run(script, test)


def test_a_stuck_connection_times_out_its_commands_and_the_next_reconnects() -> None:
    connections = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        if connections == 1:  # a hung Redis: reads, never answers
            await reader.read()
            return
        await _commands(reader, 1)
        writer.write(b"$2\r\nok\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        server = await asyncio.start_server(script, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RespClient(f"redis://127.0.0.1:{port}/0", None, timeout_s=0.2)
        loop = asyncio.get_running_loop()
        try:
            started = loop.time()
            first = asyncio.ensure_future(client.get("a"))
            await asyncio.sleep(0.1)
            results = await asyncio.gather(first, client.get("b"), return_exceptions=True)
            assert all(isinstance(r, TimeoutError) for r in results), results
            # the oldest command set the time: within timeout_s and one check period of it
            assert 0.2 <= loop.time() - started < 0.35
            assert await client.get("c") == "ok"
        finally:
            await client.close()
            server.close()

    uvloop.run(main())
    assert connections == 2


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379/0", "redis://127.0.0.1:6379/x"])
def test_a_url_that_is_not_redis_is_refused(url: str) -> None:
    with pytest.raises(InvalidInput, match="redis_url"):
        RespClient(url, None, timeout_s=1.0)
