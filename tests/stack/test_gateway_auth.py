"""Gateway authentication: 401s, the Redis token cache, coalescing, and Redis outages."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from llmchaos.stack.settings import CacheSettings
from tests.stack import gateway_fixtures as fx
from tests.stack.gateway_fixtures import (
    CHAT_BODY,
    HOT_TOKENS,
    FakeUpstream,
    GatewayClient,
    RedisServer,
    gateway_settings,
    running_gateway,
)

redis_server = fx.redis_server
token_db = fx.token_db
upstreams = fx.upstreams

Upstreams = Callable[..., Awaitable[FakeUpstream]]
NAIVE = CacheSettings(ttl_jitter_s=0.0, negative_ttl_s=0.0, coalesce_misses=False)
HARDENED = CacheSettings()
LOOKUPS = "llmchaos_gateway_token_db_lookups_total"
MISSES = "llmchaos_gateway_token_cache_misses_total"
POOL_WAIT = "llmchaos_gateway_token_db_pool_wait_seconds_sum"


@pytest.mark.parametrize(
    "authorization",
    [None, "Basic dG9rLWFsaWNl", "Bearer ", "Bearer tok-unknown", "Bearer tok-revoked"],
    ids=["missing", "not-bearer", "empty", "unknown", "revoked"],
)
@pytest.mark.asyncio
async def test_requests_without_a_valid_token_get_401(
    redis_server: RedisServer,
    token_db: Path,
    upstreams: Upstreams,
    authorization: str | None,
) -> None:
    fake = await upstreams("gpu-0")
    async with running_gateway(gateway_settings(redis_server, token_db, [fake.upstream()])) as gw:
        headers = {} if authorization is None else {"Authorization": authorization}
        status, reply_headers, body = await gw.chat(None, headers=headers)
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["type"] == "invalid_request_error"
    assert reply_headers["X-Gateway"] == "gateway-test"
    assert fake.received == []


@pytest.mark.parametrize("cache", [HARDENED, NAIVE], ids=["hardened", "naive"])
@pytest.mark.asyncio
async def test_valid_tokens_are_cached_with_ttl_and_jitter(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams, cache: CacheSettings
) -> None:
    fake = await upstreams("gpu-0")
    settings = gateway_settings(redis_server, token_db, [fake.upstream()], cache=cache)
    async with running_gateway(settings) as gw:
        for token in HOT_TOKENS * 2:
            assert (await gw.chat(token))[0] == 200
        assert await gw.metric(LOOKUPS) == len(HOT_TOKENS)
        assert await gw.metric("llmchaos_gateway_token_cache_hits_total") == len(HOT_TOKENS)
    assert redis_server.client.get("token:tok-hot-0") == "tenant-0"
    ttls_ms = [redis_server.client.pttl(f"token:{t}") for t in HOT_TOKENS]
    assert all(295_000 < ttl <= 330_000 for ttl in ttls_ms), ttls_ms
    spread_ms = max(ttls_ms) - min(ttls_ms)
    if cache.ttl_jitter_s:
        assert spread_ms > 1_000, ttls_ms  # 5 draws from 30 s land within 1 s ~never
    else:
        assert spread_ms < 1_000, ttls_ms


@pytest.mark.parametrize(
    ("cache", "lookups"), [(HARDENED, 1), (NAIVE, 5)], ids=["hardened", "naive"]
)
@pytest.mark.asyncio
async def test_unknown_tokens_are_negatively_cached_only_when_hardened(
    redis_server: RedisServer,
    token_db: Path,
    upstreams: Upstreams,
    cache: CacheSettings,
    lookups: int,
) -> None:
    fake = await upstreams("gpu-0")
    settings = gateway_settings(redis_server, token_db, [fake.upstream()], cache=cache)
    async with running_gateway(settings) as gw:
        for _ in range(5):
            assert (await gw.chat("tok-unknown"))[0] == 401
        assert await gw.metric(LOOKUPS) == lookups
        negative_hits = await gw.metric("llmchaos_gateway_token_cache_negative_hits_total")
    assert negative_hits == 5 - lookups
    ttl_ms = redis_server.client.pttl("token:tok-unknown")
    if cache.negative_ttl_s:
        assert 55_000 < ttl_ms <= 60_000
    else:
        assert ttl_ms == -2  # no such key


async def _flush_and_burst(gw: GatewayClient, redis_server: RedisServer, requests: int) -> float:
    """Warm the cache, delete every token:* key, then send `requests` at once over the hot
    tokens; returns the burst's duration. Every request must succeed."""
    for token in HOT_TOKENS:
        assert (await gw.chat(token))[0] == 200
    for key in redis_server.client.scan_iter("token:*"):
        redis_server.client.delete(key)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(gw.base_url, connector=connector) as session:

        async def one(i: int) -> tuple[int, bytes]:
            headers = {"Authorization": f"Bearer {HOT_TOKENS[i % len(HOT_TOKENS)]}"}
            async with session.post("/v1/chat/completions", json=CHAT_BODY, headers=headers) as r:
                return r.status, await r.read()

        started = time.monotonic()
        statuses = await asyncio.gather(*(one(i) for i in range(requests)))
        elapsed_s = time.monotonic() - started
    failed = [reply for reply in statuses if reply[0] != 200]
    assert not failed, failed[:3]
    return elapsed_s


@pytest.mark.asyncio
async def test_cache_flush_burst_hardened_coalesces_naive_looks_up_every_request(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    fake = await upstreams("gpu-0", max_num_seqs=1000)
    requests = 200
    results: dict[str, tuple[float, float, float, float]] = {}
    for name, cache in (("hardened", HARDENED), ("naive", NAIVE)):
        settings = gateway_settings(
            redis_server,
            token_db,
            [fake.upstream()],
            cache=cache,
            token_db_latency_ms=20.0,
            token_db_pool_size=8,
            # client, gateway and fake share one loop here: its lag in the burst must not look
            # like a worker that cannot be reached (over 1 s on a slow box beside 5 other
            # xdist workers)
            connect_timeout_s=5.0,
            first_byte_timeout_s=5.0,
        )
        async with running_gateway(settings) as gw:
            elapsed_s = await _flush_and_burst(gw, redis_server, requests)
            text = await gw.metrics()
        lookups = fx.metric_value(text, LOOKUPS) - len(HOT_TOKENS)
        misses = fx.metric_value(text, MISSES) - len(HOT_TOKENS)
        pool_wait_s = fx.metric_value(text, POOL_WAIT)
        results[name] = (lookups, misses, pool_wait_s, elapsed_s)
    (h_lookups, h_misses, h_wait_s, _), (n_lookups, n_misses, n_wait_s, _) = results.values()
    # hardened: one lookup per token in flight, the other misses wait for it
    assert h_lookups <= 2 * len(HOT_TOKENS), results
    assert h_misses >= requests / 2, results
    # naive: every miss is its own lookup, and nearly every request of the burst misses
    assert n_lookups == n_misses, results
    assert n_lookups >= 0.75 * requests, results
    # 150+ lookups through 8 connections at 20 ms queue for the pool: ~0.2 s mean wait
    assert n_wait_s / n_lookups > 0.05, results
    assert h_wait_s < 0.05, results


@pytest.mark.asyncio
async def test_redis_down_authenticates_through_sqlite_then_recovers(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    fake = await upstreams("gpu-0")
    settings = gateway_settings(redis_server, token_db, [fake.upstream()], redis_retry_s=0.2)
    async with running_gateway(settings) as gw:
        assert (await gw.chat("tok-alice"))[0] == 200
        redis_server.stop()
        started = time.monotonic()
        statuses = [(await gw.chat(t))[0] for t in ["tok-alice", "tok-bob", "tok-revoked"] * 3]
        elapsed_s = time.monotonic() - started
        assert statuses == [200, 200, 401] * 3
        assert elapsed_s < 1.0  # no per-request Redis timeout
        assert await gw.metric("llmchaos_gateway_token_cache_fallbacks_total") == 9
        assert await gw.metric(LOOKUPS) == 1 + 9

        redis_server.start()
        await asyncio.sleep(0.25)  # redis_retry_s: the gateway tries Redis again after it
        assert (await gw.chat("tok-bob"))[0] == 200
        assert (await gw.chat("tok-bob"))[0] == 200
        assert await gw.metric("llmchaos_gateway_token_cache_hits_total") >= 1
        assert await gw.metric(LOOKUPS) == 1 + 9 + 1


@pytest.mark.asyncio
async def test_unreadable_token_table_answers_503_not_500(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    fake = await upstreams("gpu-0")
    async with running_gateway(gateway_settings(redis_server, token_db, [fake.upstream()])) as gw:
        with contextlib.closing(sqlite3.connect(token_db)) as db, db:
            db.execute("DROP TABLE tokens")
        status, _, body = await gw.chat("tok-alice")
    assert status == 503
    assert body["error"]["code"] == "auth_unavailable"
    assert body["error"]["type"] == "server_error"


@pytest.mark.asyncio
async def test_hung_redis_times_out_to_sqlite_and_answers_stay_matched(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    fake = await upstreams("gpu-0")
    settings = gateway_settings(
        redis_server, token_db, [fake.upstream()], redis_timeout_s=0.2, redis_retry_s=0.3
    )
    tokens = ["tok-alice", "tok-bob"]
    async with running_gateway(settings) as gw:
        for token in tokens:
            assert (await gw.chat(token))[0] == 200
        redis_server.client.execute_command("CLIENT", "PAUSE", "1500")  # Redis hangs
        started = time.monotonic()
        for token in tokens * 3:
            assert (await gw.chat(token))[0] == 200
        assert time.monotonic() - started < 1.0  # one 0.2 s timeout, then straight to SQLite
        assert await gw.metric("llmchaos_gateway_token_cache_fallbacks_total") == 6
        hits_before = await gw.metric("llmchaos_gateway_token_cache_hits_total")

        async def served_from_cache_again() -> bool:
            assert (await gw.chat("tok-alice"))[0] == 200
            return await gw.metric("llmchaos_gateway_token_cache_hits_total") > hits_before

        await fx.wait_for(served_from_cache_again, 5.0, "Redis hits after the pause")
        fake.received.clear()
        for token in tokens * 3:
            assert (await gw.chat(token))[0] == 200
    # a reply read on a connection whose command timed out would shift tenants by one
    assert [r.headers["X-Tenant"] for r in fake.received] == ["alice", "bob"] * 3
