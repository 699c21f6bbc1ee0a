"""Fixtures and fakes of the gateway tests.

A real redis-server on a free port, a seeded SQLite token table, fake upstream workers whose
behaviour a test sets (answer, fail, hang, cut a stream, report loading), a listener that never
accepts (connect timeouts without leaving 127.0.0.1), and the gateway itself, in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import redis
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from llmchaos.stack.gateway import Gateway
from llmchaos.stack.settings import GatewaySettings, ServingMode, UpstreamWorker

MODEL = "llmchaos-7b"
TOKENS: dict[str, tuple[str, int]] = {
    "tok-alice": ("alice", 0),
    "tok-bob": ("bob", 0),
    "tok-revoked": ("mallory", 1),
    **{f"tok-hot-{i}": (f"tenant-{i}", 0) for i in range(5)},
}
"""token -> (tenant, revoked) seeded into every token table."""
HOT_TOKENS = [t for t in TOKENS if t.startswith("tok-hot-")]
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}
SSE_WORDS = ["hello", " from", " the", " fake"]


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    """Poll `predicate` every 20 ms until true; fails the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


class RedisServer:
    """A throwaway redis-server: no persistence, 127.0.0.1 only."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.client = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start and wait for PING; fails the test after 5 s."""
        self._proc = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--protected-mode", "no"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError):
                if self.client.ping():
                    return
            if self._proc.poll() is not None:
                pytest.fail(f"redis-server exited with {self._proc.returncode}")
            time.sleep(0.02)
        pytest.fail("redis-server did not answer PING within 5 s")

    def stop(self) -> None:
        """Stop the server (idempotent)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self.client.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(free_port())
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def token_db(tmp_path: Path) -> Path:
    """The token table with TOKENS, in WAL mode as the stack seeds it."""
    return write_token_db(tmp_path)


def write_token_db(folder: Path) -> Path:
    """`folder`/tokens.sqlite with TOKENS, in WAL mode as the stack seeds it."""
    path = folder / "tokens.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(
            "CREATE TABLE tokens (token TEXT PRIMARY KEY, tenant TEXT NOT NULL,"
            " revoked INTEGER NOT NULL DEFAULT 0)"
        )
        db.executemany(
            "INSERT INTO tokens VALUES (?, ?, ?)", [(t, n, r) for t, (n, r) in TOKENS.items()]
        )
    return path


@dataclass
class Received:
    """One request as a fake upstream saw it."""

    body: bytes
    headers: dict[str, str]


class FakeUpstream:
    """An OpenAI-compatible worker whose behaviour the test sets between requests.

    behaviour: "ok", "fail" (500), "hang" (no headers until stopped), "cut_stream" (one SSE
    chunk, then the connection drops). `hold` makes requests wait for an event; `health_status`,
    `health_state` and `health_hang` drive /healthz.
    """

    def __init__(self, name: str, mode: ServingMode = "gpu", max_num_seqs: int = 8) -> None:
        self.name = name
        self.mode: ServingMode = mode
        self.max_num_seqs = max_num_seqs
        self.behaviour = "ok"
        self.chunk_gap_s = 0.0
        self.hold: asyncio.Event | None = None
        self.health_status = 200
        self.health_state = "ready"
        self.health_hang = False
        self.metrics_text = ""
        """What /metrics answers (vLLM's text); empty: 404, as a worker without metrics."""
        self.received: list[Received] = []
        self.in_flight = 0
        self.cancelled = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def upstream(self) -> UpstreamWorker:
        return UpstreamWorker(name=self.name, url=self.url, mode=self.mode, node="node-test")

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        # a chat-shaped answer to completions too: without the route, a valid completions
        # request the fuzz test generated got aiohttp's plain-text 404 through the gateway
        app.router.add_post("/v1/completions", self._chat)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1
        )
        await self._runner.setup()
        # the worker's backlog: with aiohttp's default 128, a burst of new connections overflows
        # the accept queue and shows as 1 s connect stalls (a SYN retransmit)
        site = web.TCPSite(self._runner, "127.0.0.1", port, backlog=1024)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        if self.health_hang:
            await asyncio.sleep(3600)
        body = {"status": self.health_state, "name": self.name, "mode": self.mode}
        if self.health_state == "ready":
            body |= {"node": "node-test", "max_num_seqs": self.max_num_seqs, "pid": 1}
        return web.json_response(body, status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self.metrics_text:
            return web.Response(status=404)
        return web.Response(text=self.metrics_text)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(Received(body, dict(request.headers)))
        self.in_flight += 1
        try:
            if self.hold is not None:
                await self.hold.wait()
            if self.behaviour == "hang":
                await asyncio.sleep(3600)
            if self.behaviour == "fail":
                return web.json_response({"error": {"message": "boom"}}, status=500)
            headers = {"X-Serving-Mode": self.mode, "X-Worker": self.name}
            if not json.loads(body).get("stream"):
                return web.json_response(_completion(self.name), headers=headers)
            return await self._stream(request, headers)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await response.prepare(request)
        for i, word in enumerate(SSE_WORDS):
            await response.write(_sse_chunk(self.name, word))
            if self.behaviour == "cut_stream":
                assert request.transport is not None
                request.transport.abort()
                return response
            if self.chunk_gap_s and i < len(SSE_WORDS) - 1:
                await asyncio.sleep(self.chunk_gap_s)
        await response.write(_sse_chunk(self.name, None) + b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _completion(worker: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{worker}",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": f"served by {worker}"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
    }


def _sse_chunk(worker: str, word: str | None) -> bytes:
    chunk = {
        "id": f"chatcmpl-{worker}",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "delta": {} if word is None else {"content": word},
                "finish_reason": "stop" if word is None else None,
            }
        ],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@pytest_asyncio.fixture
async def upstreams() -> AsyncIterator[Callable[..., Awaitable[FakeUpstream]]]:
    """Factory of started fake upstreams, all stopped at the end."""
    started: list[FakeUpstream] = []

    async def make(name: str, mode: ServingMode = "gpu", max_num_seqs: int = 8) -> FakeUpstream:
        fake = FakeUpstream(name, mode, max_num_seqs)
        await fake.start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        if fake.hold is not None:
            fake.hold.set()
        await fake.stop()


@contextlib.contextmanager
def never_accepting_listener(port: int = 0) -> Iterator[UpstreamWorker]:
    """A listener whose accept queue is full, so new connections hang in SYN: what a
    partitioned worker looks like, without leaving 127.0.0.1."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(0)
    address = listener.getsockname()
    fillers: list[socket.socket] = []
    try:
        for _ in range(8):
            filler = socket.socket()
            filler.settimeout(0.2)
            fillers.append(filler)
            try:
                filler.connect(address)
            except TimeoutError:
                break
        else:
            pytest.fail("could not fill the accept queue of the test listener")
        url = f"http://127.0.0.1:{address[1]}"
        yield UpstreamWorker(name="gpu-blackhole", url=url, mode="gpu")
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def refusing_worker(name: str = "gpu-refusing", mode: ServingMode = "gpu") -> UpstreamWorker:
    """A worker address nothing listens on."""
    return UpstreamWorker(name=name, url=f"http://127.0.0.1:{free_port()}", mode=mode)


def gateway_settings(
    redis_server: RedisServer, token_db: Path, workers: list[UpstreamWorker], **overrides: Any
) -> GatewaySettings:
    """Settings with short timeouts so failures show within a test's time."""
    base = GatewaySettings(
        name="gateway-test",
        port=0,
        models=(MODEL,),
        workers=tuple(workers),
        redis_url=redis_server.url,
        token_db_path=str(token_db),
        token_db_latency_ms=1.0,
        health_interval_s=0.1,
        health_timeout_s=0.3,
        eject_s=30.0,
        connect_timeout_s=0.3,
        first_byte_timeout_s=1.0,
    )
    return replace(base, **overrides)


@contextlib.asynccontextmanager
async def running_gateway(settings: GatewaySettings) -> AsyncIterator[GatewayClient]:
    """The gateway in-process, with a client session pointed at it."""
    gateway = Gateway(settings)
    await gateway.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{gateway.port}") as session:
            yield GatewayClient(gateway, session)
    finally:
        await gateway.stop()


@dataclass
class GatewayClient:
    gateway: Gateway
    session: aiohttp.ClientSession

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    async def chat(
        self, token: str | None = "tok-alice", body: dict[str, Any] | None = None, **kw: Any
    ) -> tuple[int, dict[str, str], Any]:
        """POST a chat completion; returns status, headers and the decoded JSON body."""
        headers = kw.pop("headers", {})
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        async with self.session.post(
            "/v1/chat/completions", json=body or CHAT_BODY, headers=headers, **kw
        ) as resp:
            return resp.status, dict(resp.headers), await resp.json(content_type=None)

    async def metrics(self) -> str:
        async with self.session.get("/metrics") as resp:
            return await resp.text()

    async def metric(self, name: str, **labels: str) -> float:
        return metric_value(await self.metrics(), name, **labels)

    async def healthy(self) -> dict[str, int]:
        async with self.session.get("/healthz") as resp:
            return dict((await resp.json())["healthy_workers"])
