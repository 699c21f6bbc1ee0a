"""The gateways' client to their workers (llmchaos.stack.gateway.upstream) against scripted
raw servers: connections kept alive and reused only when clean, streamed and chunked bodies,
and each failure with the proxy's reason."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from yarl import URL

from llmchaos.stack.gateway.upstream import UpstreamError, UpstreamPool

pytestmark = pytest.mark.asyncio

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Worker: w\r\n"
    b"Content-Length: 2\r\n\r\n{}"
)


@asynccontextmanager
async def _server(script: Script) -> AsyncIterator[tuple[URL, list[int]]]:
    """A server that runs `script` on each connection; yields its URL and the counts of
    connections it accepted and saw end."""
    accepted = [0, 0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        try:
            await script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            accepted[1] += 1
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield URL(f"http://127.0.0.1:{port}/v1/chat/completions"), accepted
    finally:
        server.close()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


async def _answer_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await _read_request(reader)
        writer.write(OK)
        await writer.drain()


async def test_a_clean_answer_keeps_its_connection_for_the_next() -> None:
    pool = UpstreamPool(connect_timeout_s=1.0, read_timeout_s=2.0)
    async with _server(_answer_forever) as (url, accepted):
        for _ in range(3):
            response = await pool.post(url, b'{"a": 1}', {"X-Tenant": "t"})
            assert (response.status, response.headers["x-worker"]) == (200, "w")
            assert await response.read() == b"{}"
            response.release()
        assert accepted[0] == 1
    pool.close()


async def test_an_informational_answer_is_skipped_and_the_connection_stays_clean() -> None:
    async def continue_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)  # the real answer in a read of its own
            writer.write(OK)
            await writer.drain()

    pool = UpstreamPool(connect_timeout_s=1.0, read_timeout_s=2.0)
    async with _server(continue_first) as (url, accepted):
        for _ in range(2):
            response = await pool.post(url, b"{}", {})
            assert (response.status, await response.read()) == (200, b"{}")
            response.release()
        assert accepted[0] == 1
    pool.close()


async def test_an_answer_left_half_way_closes_its_connection() -> None:
    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
        await writer.drain()
        await asyncio.sleep(5)

    pool = UpstreamPool(connect_timeout_s=1.0, read_timeout_s=2.0)
    async with _server(half) as (url, accepted):
        for _ in range(2):
            response = await pool.post(url, b"{}", {})
            assert await response.readany() == b"ab"
            response.release()  # the rest never read: not pooled
        assert accepted[0] == 2
    pool.close()


async def test_a_chunked_stream_arrives_in_pieces() -> None:
    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
        for event in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    pool = UpstreamPool(connect_timeout_s=1.0, read_timeout_s=2.0)
    async with _server(stream) as (url, _):
        response = await pool.post(url, b"{}", {})
        pieces = []
        while piece := await response.readany():
            pieces.append(piece)
        assert pieces == [b"data: 1\n\n", b"data: 2\n\n"]
        response.release()
    pool.close()


async def _cut_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    await writer.drain()


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(5)


async def _garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(1)


@pytest.mark.parametrize(
    ("script", "reason"),
    [(_cut_body, "disconnect"), (_silent, "read_timeout"), (_garbage, "disconnect")],
    ids=["cut-body", "silent", "not-http"],
)
async def test_failures_carry_the_proxys_reason(script: Script, reason: str) -> None:
    pool = UpstreamPool(connect_timeout_s=1.0, read_timeout_s=0.3)
    async with _server(script) as (url, _):
        with pytest.raises(UpstreamError) as caught:
            response = await pool.post(url, b"{}", {})
            await response.read()
    assert caught.value.reason == reason
    pool.close()


async def test_a_closed_port_is_a_connect_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pool = UpstreamPool(connect_timeout_s=1.0, read_timeout_s=1.0)
    with pytest.raises(UpstreamError) as caught:
        await pool.post(URL(f"http://127.0.0.1:{port}/v1/completions"), b"{}", {})
    assert caught.value.reason == "connect_error"


async def test_a_request_given_up_on_drops_its_connection() -> None:
    pool = UpstreamPool(connect_timeout_s=1.0, read_timeout_s=5.0)
    async with _server(_answer_forever) as (url, accepted):
        slow = await pool.post(url, b"{}", {})
        await slow.read()
        slow.release()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0):  # cancelled before the answer came
                await pool.post(url, b"{}", {})
        response = await pool.post(url, b"{}", {})  # not on the abandoned connection
        assert await response.read() == b"{}"
        response.release()
        assert accepted[0] == 2
        await asyncio.sleep(0.1)
        assert accepted[1] == 1  # the abandoned one was closed, not left open
    pool.close()
