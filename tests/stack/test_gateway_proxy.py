"""Gateway proxying: plain and streamed completions, headers, validation, broken streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from openai import AsyncOpenAI

from tests.stack import gateway_fixtures as fx
from tests.stack.gateway_fixtures import (
    CHAT_BODY,
    MODEL,
    SSE_WORDS,
    FakeUpstream,
    RedisServer,
    gateway_settings,
    running_gateway,
    wait_for,
)

redis_server = fx.redis_server
token_db = fx.token_db
upstreams = fx.upstreams

Upstreams = Callable[..., Awaitable[FakeUpstream]]


@pytest.mark.asyncio
async def test_plain_completion_through_openai_client(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    fake = await upstreams("gpu-0")
    settings = gateway_settings(redis_server, token_db, [fake.upstream()])
    async with running_gateway(settings) as gw:
        client = AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key="tok-alice", max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        completion = raw.parse()
        await client.close()
    assert completion.choices[0].message.content == "served by gpu-0"
    assert raw.headers["x-serving-mode"] == "gpu"
    assert raw.headers["x-worker"] == "gpu-0"
    assert raw.headers["x-gateway"] == "gateway-test"
    (received,) = fake.received
    assert received.headers["X-Tenant"] == "alice"
    assert "Authorization" not in received.headers


@pytest.mark.asyncio
async def test_body_bytes_and_traceparent_are_forwarded_as_sent(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    fake = await upstreams("gpu-0")
    settings = gateway_settings(redis_server, token_db, [fake.upstream()])
    raw = b'{ "messages":[{"role":"user","content":"x"}],   "model":"llmchaos-7b", "n":1 }'
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with running_gateway(settings) as gw:
        headers = {"Authorization": "Bearer tok-bob", "traceparent": trace}
        async with gw.session.post("/v1/chat/completions", data=raw, headers=headers) as resp:
            assert resp.status == 200
    (received,) = fake.received
    assert received.body == raw
    assert received.headers["traceparent"] == trace


@pytest.mark.asyncio
async def test_stream_chunks_are_piped_as_they_arrive(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    fake = await upstreams("gpu-0")
    fake.chunk_gap_s = 0.3
    settings = gateway_settings(redis_server, token_db, [fake.upstream()])
    async with running_gateway(settings) as gw:
        client = AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key="tok-alice", max_retries=0)
        started = time.monotonic()
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        arrivals: list[tuple[float, str]] = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append((time.monotonic() - started, chunk.choices[0].delta.content))
        await client.close()
        assert await gw.metric("llmchaos_gateway_requests_total", mode="gpu", code="200") == 1
    assert [word for _, word in arrivals] == SSE_WORDS
    # buffering would deliver everything at once after the last gap (>= 0.9 s)
    assert arrivals[0][0] < 0.25, arrivals
    assert arrivals[-1][0] - arrivals[0][0] >= 0.85, arrivals


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b'{"model": "llmchaos-7b"}', 400, "missing_required_parameter"),
        (
            b'{"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "model_not_found",
        ),
    ],
    ids=["bad-json", "no-messages", "unknown-model"],
)
@pytest.mark.asyncio
async def test_invalid_requests_get_openai_errors_without_reaching_workers(
    redis_server: RedisServer,
    token_db: Path,
    upstreams: Upstreams,
    body: bytes,
    status: int,
    code: str,
) -> None:
    fake = await upstreams("gpu-0")
    settings = gateway_settings(redis_server, token_db, [fake.upstream()])
    async with running_gateway(settings) as gw:
        headers = {"Authorization": "Bearer tok-alice"}
        async with gw.session.post("/v1/chat/completions", data=body, headers=headers) as resp:
            payload = await resp.json()
            assert resp.status == status
            assert resp.headers["X-Gateway"] == "gateway-test"
            assert "X-Serving-Mode" not in resp.headers
    assert payload["error"]["code"] == code
    assert payload["error"]["type"] == "invalid_request_error"
    assert fake.received == []


@pytest.mark.asyncio
async def test_models_healthz_metrics_and_unknown_routes(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    fake = await upstreams("gpu-0")
    cpu = await upstreams("cpu-0", mode="cpu")
    settings = gateway_settings(redis_server, token_db, [fake.upstream(), cpu.upstream()])
    async with running_gateway(settings) as gw:
        auth = {"Authorization": "Bearer tok-alice"}
        async with gw.session.get("/v1/models", headers=auth) as resp:
            assert resp.status == 200
            assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
        async with gw.session.get("/v1/models") as resp:
            assert resp.status == 401
        async with gw.session.get("/healthz") as resp:
            health = await resp.json()
            assert resp.status == 200
        assert health["healthy_workers"] == {"gpu": 1, "cpu": 1}
        async with gw.session.get("/v1/nope") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "not_found"
            assert resp.headers["X-Gateway"] == "gateway-test"
        text = await gw.metrics()
    for name in (
        "llmchaos_gateway_healthy_workers",
        "llmchaos_gateway_estimated_queue",
        "llmchaos_gateway_upstream_outstanding",
        "llmchaos_gateway_token_db_lookups_total",
        "llmchaos_gateway_token_db_pool_wait_seconds_bucket",
    ):
        assert name in text


@pytest.mark.asyncio
async def test_worker_dying_mid_stream_breaks_the_client_stream(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    fake = await upstreams("gpu-0")
    fake.behaviour = "cut_stream"
    settings = gateway_settings(redis_server, token_db, [fake.upstream()])
    async with running_gateway(settings) as gw:
        headers = {"Authorization": "Bearer tok-alice"}
        body = {**CHAT_BODY, "stream": True}
        async with gw.session.post("/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        assert await gw.metric("llmchaos_gateway_broken_streams_total") == 1
        assert gw.gateway.pool.healthy_counts()["gpu"] in (0, 1)  # ejected, maybe readmitted


@pytest.mark.asyncio
async def test_client_disconnect_cancels_the_upstream_request(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    fake = await upstreams("gpu-0")
    fake.hold = asyncio.Event()
    settings = gateway_settings(redis_server, token_db, [fake.upstream()])
    async with running_gateway(settings) as gw:
        with pytest.raises(asyncio.TimeoutError):
            await gw.chat(timeout=aiohttp.ClientTimeout(total=0.3))

        async def upstream_cancelled() -> bool:
            return fake.cancelled == 1 and fake.in_flight == 0

        await wait_for(upstream_cancelled, 3.0, "the fake upstream to see the cancellation")
        assert gw.gateway.pool.workers[0].outstanding == 0
        assert await gw.metric("llmchaos_gateway_client_disconnects_total") == 1
