"""The workers' HTTP/1.1 server (llmchaos.stack.httpserver) on raw sockets: framing both ways,
keep-alive and pipelining, HTTP/1.0, errors it answers itself, malformed input, a client that
leaves, idle connections and the stop."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from llmchaos.stack.httpserver import HttpError, HttpServer, Request, Responder, Response
from tests.stack.malformed_http import MALFORMED_REQUESTS

pytestmark = pytest.mark.asyncio


class _App:
    """Routes for the tests, and what their handlers saw."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.entered = asyncio.Event()

    async def echo(self, request: Request, _: Responder) -> Response:
        body = {"method": request.method, "query": request.query, "body": request.body.decode()}
        return Response(body=json.dumps(body).encode(), headers=[("X-Echo", "1")])

    async def stream(self, request: Request, responder: Responder) -> None:
        await responder.start(200, [("Content-Type", "text/event-stream")])
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            await responder.write(part)
        await responder.end()

    async def broken_stream(self, request: Request, responder: Responder) -> None:
        await responder.start(200)
        await responder.write(b"data: 1\n\n")
        raise RuntimeError("the engine died")

    async def slow(self, request: Request, _: Responder) -> Response:
        await asyncio.sleep(0.3)
        return Response(body=b"{}")

    async def boom(self, request: Request, _: Responder) -> Response:
        raise RuntimeError("boom")

    async def hang(self, request: Request, _: Responder) -> Response:
        self.entered.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return Response()


def _on_error(exc: BaseException, request: Request | None) -> Response:
    status = exc.status if isinstance(exc, HttpError) else 500
    headers = [("Allow", exc.allow)] if isinstance(exc, HttpError) and exc.allow else []
    body = {"error": {"message": str(exc), "where": request.path if request else None}}
    return Response(status, json.dumps(body).encode(), headers=headers)


@asynccontextmanager
async def _serving(keepalive_s: float = 75.0) -> AsyncIterator[tuple[int, _App, HttpServer]]:
    app = _App()
    routes = {
        "/echo": {"GET": app.echo, "POST": app.echo},
        "/stream": {"GET": app.stream},
        "/broken-stream": {"GET": app.broken_stream},
        "/boom": {"GET": app.boom},
        "/slow": {"GET": app.slow},
        "/hang": {"GET": app.hang},
    }
    server = HttpServer(
        routes, _on_error, headers=[("X-Worker", "t")], max_body_bytes=1000, keepalive_s=keepalive_s
    )
    port = await server.start("127.0.0.1", 0)
    try:
        yield port, app, server
    finally:
        server.close()
        await server.wait_closed(0.5)


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer: status, headers (lower-case names), body (Content-Length, chunked, or to
    the end of the connection)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await asyncio.wait_for(reader.read(), 5)
    return status, headers, body


async def _exchange(port: int, raw: bytes, answers: int = 1) -> list[tuple[int, dict, bytes]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        return [await _read_answer(reader) for _ in range(answers)]
    finally:
        writer.close()


async def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    async with _serving() as (port, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /echo?a=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await _read_answer(reader)
        assert (status, headers["x-worker"], headers["x-echo"]) == (200, "t", "1")
        assert "connection" not in headers and json.loads(body)["query"] == "a=1"
        # two at once on the same connection
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none"
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\ntwo"
        )
        bodies = [json.loads((await _read_answer(reader))[2])["body"] for _ in range(2)]
        assert bodies == ["one", "two"]
        writer.close()


async def test_http_1_0_closes_and_streams_until_the_close() -> None:
    async with _serving() as (port, _, _):
        ((status, headers, body),) = await _exchange(port, b"GET /echo HTTP/1.0\r\n\r\n")
        assert status == 200 and headers["connection"] == "close"
        ((status, headers, body),) = await _exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")
        assert "transfer-encoding" not in headers and body == b"data: 1\n\ndata: 2\n\n"
        # chunked for HTTP/1.1
        ((_, headers, body),) = await _exchange(port, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        assert headers["transfer-encoding"] == "chunked" and body == b"data: 1\n\ndata: 2\n\n"


async def test_bodies_chunked_or_announced_with_100_continue_and_the_limit() -> None:
    async with _serving() as (port, _, _):
        chunked = (
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        )
        ((status, _, body),) = await _exchange(port, chunked)
        assert (status, json.loads(body)["body"]) == (200, "abcde")
        expect = (
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
        )
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(expect)
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
            b"HTTP/1.1 100 Continue\r\n\r\n"
        )
        writer.write(b"ok")
        assert json.loads((await _read_answer(reader))[2])["body"] == "ok"
        writer.close()
        over = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n" + b"x" * 1001
        ((status, headers, _),) = await _exchange(port, over)
        assert status == 413 and headers["connection"] == "close"
        chunked_over = (
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"3e8\r\n" + b"x" * 1000 + b"\r\n" + b"2\r\nxx\r\n0\r\n\r\n"
        )  # fmt: skip
        ((status, _, _),) = await _exchange(port, chunked_over)
        assert status == 413


async def test_routes_methods_head_and_handler_errors() -> None:
    async with _serving() as (port, _, _):
        ((status, _, body),) = await _exchange(port, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 404 and json.loads(body)["error"]["where"] == "/nope"
        ((status, headers, _),) = await _exchange(port, b"PUT /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 405 and headers["allow"] == "GET,HEAD,POST"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\nGET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: " in head
        status, _, body = await _read_answer(reader)  # HEAD's body was not sent: this is /boom's
        assert status == 500 and json.loads(body)["error"]["message"] == "boom"
        writer.close()
        # a stream that fails half way is cut: no last chunk, the connection closes
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /broken-stream HTTP/1.1\r\nHost: x\r\n\r\n")
        received = await asyncio.wait_for(reader.read(), 5)
        assert b"data: 1" in received and not received.endswith(b"0\r\n\r\n")
        writer.close()


@pytest.mark.parametrize("raw", MALFORMED_REQUESTS)
async def test_malformed_http_gets_a_400_and_the_connection_closes(
    raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with _serving() as (port, _, _):
        ((status, headers, body),) = await _exchange(port, raw)
    assert status == 400 and headers["connection"] == "close", (status, body)
    assert json.loads(body)["error"]["where"] is None
    assert "malformed HTTP request" in caplog.text and "Traceback" not in caplog.text


async def test_requests_before_a_malformed_one_are_answered_first() -> None:
    # a header value with a line break ends the headers early: what follows is garbage
    raw = (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nX-A: b\r\n\r\n"
        b"Cont\x01ent: y\r\n\r\n"
    )
    async with _serving() as (port, _, _):
        (first, second) = await _exchange(port, raw, answers=2)
    assert (first[0], json.loads(first[2])["body"]) == (200, "Cont")
    assert second[0] == 400 and second[1]["connection"] == "close"


async def test_a_client_that_leaves_cancels_its_handler_and_idle_connections_close() -> None:
    async with _serving(keepalive_s=0.3) as (port, app, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(app.entered.wait(), 5)
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 5)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read_answer(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed when idle 0.3 s
        writer.close()


async def test_stop_gives_running_handlers_their_grace_then_cuts_them() -> None:
    async with _serving() as (port, app, server):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(app.entered.wait(), 5)
        server.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        started = asyncio.get_running_loop().time()
        await server.wait_closed(0.2)
        assert app.cancelled.is_set()
        assert asyncio.get_running_loop().time() - started < 2.0
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_a_client_still_sending_a_body_over_the_limit_reads_the_413() -> None:
    async with _serving() as (port, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
        for _ in range(10):  # keeps sending after the answer went out
            writer.write(b"x" * 100_000)
            await writer.drain()
        status, headers, _ = await _read_answer(reader)
        assert status == 413 and headers["connection"] == "close"
        writer.close()


async def test_a_stalled_request_and_http_1_0_keep_alive() -> None:
    async with _serving(keepalive_s=0.3) as (port, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        status, headers, _ = await _read_answer(reader)
        assert status == 200 and headers["connection"] == "keep-alive"
        writer.write(b"GET /echo HTTP/1.0\r\n\r\n")  # the same connection, then closed
        assert (await _read_answer(reader))[0] == 200
        writer.close()


async def test_stopping_answers_the_request_in_flight_with_connection_close() -> None:
    async with _serving() as (port, _, server):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.05)
        server.close()
        status, headers, _ = await _read_answer(reader)
        assert status == 200 and headers["connection"] == "close"
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after the answer
        writer.close()
