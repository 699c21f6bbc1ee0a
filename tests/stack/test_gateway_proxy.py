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
    GatewayClient,
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


HEDGED = "llmchaos_gateway_hedged_requests_total"
RETRIES = "llmchaos_gateway_upstream_retries_total"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.asyncio
async def test_a_request_its_worker_sits_on_is_hedged_to_another(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams, stream: bool
) -> None:
    """A worker that sends nothing back (a slow GPU, a degraded link: its health checks pass)
    costs the client hedge_after_s, not first_byte_timeout_s: a twin goes to another worker,
    its answer is returned, the slow attempt is cancelled and its worker ejected."""
    slow, fast = await upstreams("gpu-0"), await upstreams("gpu-1")
    slow.hold = asyncio.Event()
    settings = gateway_settings(
        redis_server,
        token_db,
        [slow.upstream(), fast.upstream()],
        hedge_after_s=0.3,
        first_byte_timeout_s=5.0,
    )
    async with running_gateway(settings) as gw:
        await wait_for(_both_healthy(gw), 3.0, "both workers healthy")
        took_s = []
        for _ in range(2):  # idle workers take turns: one of the two lands on the slow one
            started = time.monotonic()
            async with gw.session.post(
                "/v1/chat/completions",
                json={**CHAT_BODY, "stream": stream},
                headers={"Authorization": "Bearer tok-alice"},
            ) as resp:
                assert (resp.status, resp.headers["X-Worker"]) == (200, "gpu-1")
                text = await resp.text()
            took_s.append(time.monotonic() - started)
            assert ("[DONE]" in text) == stream
        assert await gw.metric(HEDGED, winner="hedge") == 1
        assert await gw.metric(HEDGED, winner="first") == 0
        # outrun by a peer that answered within hedge_after_s: a gray failure, ejected
        assert await gw.healthy() == {"gpu": 1, "cpu": 0}

        async def slow_attempt_cancelled() -> bool:
            return slow.cancelled == 1 and slow.in_flight == 0

        await wait_for(slow_attempt_cancelled, 3.0, "the slow attempt to be cancelled")
        assert [w.outstanding for w in gw.gateway.pool.workers] == [0, 0]
        slow.hold.set()
    assert len(slow.received) == 1 and len(fast.received) == 2
    assert 0.3 <= max(took_s) < 2.0, took_s


@pytest.mark.parametrize("failover", [True, False])
@pytest.mark.asyncio
async def test_hedges_stay_within_their_budget_and_need_failover(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams, failover: bool
) -> None:
    """With every worker slow, hedging would double the load: beyond the bucket's burst only
    hedge_budget_ratio of the requests are hedged (none here). Without failover (a Service
    without readiness) nothing is hedged at all."""
    a, b = await upstreams("gpu-0"), await upstreams("gpu-1")
    a.hold = b.hold = asyncio.Event()
    settings = gateway_settings(
        redis_server,
        token_db,
        [a.upstream(), b.upstream()],
        hedge_after_s=0.1,
        hedge_budget_ratio=0.0,
        first_byte_timeout_s=5.0,
        failover=failover,
    )
    async with running_gateway(settings) as gw:
        await wait_for(_both_healthy(gw), 3.0, "both workers healthy")
        replies = [asyncio.ensure_future(gw.chat()) for _ in range(14)]
        await asyncio.sleep(0.6)
        sent = len(a.received) + len(b.received)
        a.hold.set()
        assert [r[0] for r in await asyncio.gather(*replies)] == [200] * 14
        hedged = await gw.metric(HEDGED, winner="hedge") + await gw.metric(HEDGED, winner="first")
        # every twin was as slow as its first attempt: an overloaded pool, nobody ejected
        assert await gw.healthy() == {"gpu": 2, "cpu": 0}
    assert sent == (14 + 10 if failover else 14)  # the bucket's burst of 10, then none
    assert hedged == (10 if failover else 0)


def _both_healthy(gw: GatewayClient) -> Callable[[], Awaitable[bool]]:
    async def healthy() -> bool:
        return await gw.healthy() == {"gpu": 2, "cpu": 0}

    return healthy


@pytest.mark.asyncio
async def test_a_long_prompt_is_not_hedged(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    """A prompt over hedge_max_prompt_tokens waits for its worker (then the retry on a
    first-byte timeout): its prefill is slow by nature, and a twin would double it."""
    slow, fast = await upstreams("gpu-0"), await upstreams("gpu-1")
    slow.hold = asyncio.Event()
    settings = gateway_settings(
        redis_server,
        token_db,
        [slow.upstream(), fast.upstream()],
        hedge_after_s=0.1,
        hedge_max_prompt_tokens=5,
        first_byte_timeout_s=1.0,
    )
    long_prompt = {**CHAT_BODY, "messages": [{"role": "user", "content": "word " * 6}]}
    async with running_gateway(settings) as gw:
        await wait_for(_both_healthy(gw), 3.0, "both workers healthy")
        for _ in range(2):  # one of the two lands on the slow worker
            assert (await gw.chat(body=long_prompt))[0] == 200
        assert await gw.metric(HEDGED, winner="hedge") == 0
        assert await gw.metric(RETRIES, reason="first_byte_timeout") == 1
        slow.hold.set()
