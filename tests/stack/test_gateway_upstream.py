"""The gateway's HTTP/1.1 client to its workers (upstream.py), against scripted peers.

Run on uvloop, as the gateway does (its transports are not asyncio.Transport subclasses).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop
from yarl import URL

from llmchaos.stack.gateway.upstream import UpstreamClient, UpstreamFailed
from tests.stack import gateway_fixtures as fx

WAIT_S = 5.0
"""The first-byte timeout of the tests that do not test it."""
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Test = Callable[[UpstreamClient, URL], Coroutine[Any, Any, None]]

OK = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Worker: w-1\r\n"
    b"Content-Length: 2\r\n\r\n{}"
)


class Peer:
    """Serves each connection with a script; counts connections."""

    def __init__(self, script: Script) -> None:
        self.connections = 0
        self._script = script

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self._script(reader, writer)
        finally:
            writer.close()


def _run(peer: Peer, test: Test, read_timeout_s: float = 5.0) -> None:
    async def main() -> None:
        server = await asyncio.start_server(peer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = UpstreamClient(connect_timeout_s=1.0, read_timeout_s=read_timeout_s)
        try:
            await asyncio.wait_for(test(client, URL(f"http://127.0.0.1:{port}/v1/x")), 5.0)
        finally:
            client.close()
            server.close()

    uvloop.run(main())


async def _request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (framed by Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


async def _answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            await _request(reader)
        except asyncio.IncompleteReadError:
            return
        writer.write(OK)
        await writer.drain()


def test_keep_alive_connection_is_reused_and_request_is_sent_as_given() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(3):
            seen.append(await _request(reader))
            writer.write(OK)
        await reader.read()

    async def test(client: UpstreamClient, url: URL) -> None:
        for i in range(3):
            response = await client.post(url, b"X-Tenant: alice\r\n", b'{"n": %d}' % i, WAIT_S)
            assert response.status == 200
            assert response.headers["x-worker"] == "w-1"
            assert await response.read() == b"{}"
            response.release()

    peer = Peer(script)
    _run(peer, test)
    assert peer.connections == 1
    head, body = seen[2]
    assert head.startswith(b"POST /v1/x HTTP/1.1\r\n")
    assert b"\r\nX-Tenant: alice\r\n" in head
    assert b"\r\nContent-Length: 8\r\n" in head
    assert body == b'{"n": 2}'


@pytest.mark.parametrize(
    ("answer", "reused"),
    [
        (OK.replace(b"Content-Length", b"Connection: close\r\nContent-Length"), False),
        (b"HTTP/1.1 200 OK\r\n\r\n{}", False),  # framed by the close
        (OK, True),
    ],
    ids=["connection-close", "until-close", "keep-alive"],
)
def test_a_connection_the_worker_closes_is_not_reused(answer: bytes, reused: bool) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await _request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(answer)
            await writer.drain()
            if not answer.startswith(OK):
                return

    async def test(client: UpstreamClient, url: URL) -> None:
        for _ in range(2):
            response = await client.post(url, b"", b"{}", WAIT_S)
            assert await response.read() == b"{}"
            response.release()
            await asyncio.sleep(0.05)  # the close arrives

    peer = Peer(script)
    _run(peer, test)
    assert peer.connections == (1 if reused else 2)


def test_chunked_stream_is_read_as_it_arrives_then_pooled() -> None:
    gate = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await gate.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await _answer_each(reader, writer)

    async def test(client: UpstreamClient, url: URL) -> None:
        response = await client.post(url, b"", b"{}", WAIT_S)
        assert await response.read_chunk() == b"first"
        gate.set()
        assert await response.read_chunk() == b"second"
        assert await response.read_chunk() == b""
        response.release()
        again = await client.post(url, b"", b"{}", WAIT_S)
        assert await again.read() == b"{}"
        again.release()

    peer = Peer(script)
    _run(peer, test)
    assert peer.connections == 1


@pytest.mark.parametrize(
    ("answer", "where"),
    [
        (b"", "head"),
        (b"HTTP/1.1 200 OK\r\nContent-", "head"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "head"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345", "body"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "body"),
    ],
    ids=["closed-before-answer", "cut-in-head", "bad-status", "cut-in-body", "bad-chunk"],
)
def test_a_cut_or_malformed_answer_is_a_disconnect(answer: bytes, where: str) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(answer)
        await writer.drain()

    async def test(client: UpstreamClient, url: URL) -> None:
        with pytest.raises(UpstreamFailed) as failed:
            response = await client.post(url, b"", b"{}", WAIT_S)
            assert where == "body"
            await response.read()
        assert failed.value.reason == "disconnect"

    _run(Peer(script), test)


@pytest.mark.parametrize(
    ("first_byte_s", "head", "reason"),
    [
        (0.1, b"", "first_byte_timeout"),
        (5.0, b"", "read_timeout"),
        (0.1, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n12", "read_timeout"),
    ],
    ids=["no-head-within-first-byte", "no-head-within-read", "body-stalls"],
)
def test_a_silent_worker_times_out(first_byte_s: float, head: bytes, reason: str) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(head)
        await reader.read()

    async def test(client: UpstreamClient, url: URL) -> None:
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamFailed) as failed:
            response = await client.post(url, b"", b"{}", first_byte_s)
            await response.read()  # the head came: the first-byte limit is over
        assert failed.value.reason == reason
        assert asyncio.get_running_loop().time() - started < 1.0

    _run(Peer(script), test, read_timeout_s=0.3)


def test_an_answer_released_unread_or_cancelled_closes_its_connection() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                _, body = await _request(reader)
            except asyncio.IncompleteReadError:
                return
            if body == b"partial":  # the rest of the body would follow
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
            elif body != b"hang":
                writer.write(OK)

    async def test(client: UpstreamClient, url: URL) -> None:
        unread = await client.post(url, b"", b"partial", WAIT_S)
        unread.release()
        task = asyncio.ensure_future(client.post(url, b"", b"hang", WAIT_S))
        await asyncio.sleep(0.05)  # waiting for the answer's head
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        last = await client.post(url, b"", b"{}", WAIT_S)
        assert await last.read() == b"{}"
        last.release()

    peer = Peer(script)
    _run(peer, test)
    assert peer.connections == 3


def test_connect_failures_are_named() -> None:
    async def main() -> None:
        client = UpstreamClient(connect_timeout_s=0.2, read_timeout_s=1.0)
        refusing = URL(fx.refusing_worker().url + "/v1/x")
        with pytest.raises(UpstreamFailed) as failed:
            await client.post(refusing, b"", b"{}", WAIT_S)
        assert failed.value.reason == "connect_error"
        with fx.never_accepting_listener() as blackhole:
            with pytest.raises(UpstreamFailed) as failed:
                await client.post(URL(blackhole.url + "/v1/x"), b"", b"{}", WAIT_S)
            assert failed.value.reason == "connect_timeout"
            with pytest.raises(UpstreamFailed) as failed:  # the tighter limit names it
                await client.post(URL(blackhole.url + "/v1/x"), b"", b"{}", 0.1)
            assert failed.value.reason == "first_byte_timeout"

    uvloop.run(main())
