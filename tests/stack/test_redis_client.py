"""The gateways' Redis client against a real redis-server: values, a missing key and an empty
value told apart, a command given up on, the password, the database number, and a lost
connection."""

from __future__ import annotations

import asyncio

import pytest

from llmchaos.stack.gateway.redis_client import RedisClient, RedisReplyError
from tests.stack import gateway_fixtures as fx
from tests.stack.gateway_fixtures import RedisServer

redis_server = fx.redis_server
pytestmark = pytest.mark.asyncio


async def test_get_set_missing_and_empty(redis_server: RedisServer) -> None:
    client = RedisClient(redis_server.url, password=None, connect_timeout_s=1.0)
    try:
        await client.set("token:a", "tenant-a", px=60_000)
        await client.set("token:revoked", "", px=60_000)  # a negative entry is an empty value
        assert await client.get("token:a") == "tenant-a"
        assert await client.get("token:revoked") == ""
        assert await client.get("token:nope") is None
        assert 0 < redis_server.client.pttl("token:a") <= 60_000
        # many at once on the one connection: each gets its own reply
        keys = [f"token:{i}" for i in range(200)]
        await asyncio.gather(*(client.set(k, k.upper(), px=60_000) for k in keys))
        assert await asyncio.gather(*(client.get(k) for k in keys)) == [k.upper() for k in keys]
    finally:
        client.close()


async def test_a_command_given_up_on_drops_its_connection(redis_server: RedisServer) -> None:
    client = RedisClient(redis_server.url, password=None, connect_timeout_s=1.0)
    try:
        await client.set("token:b", "tenant-b", px=60_000)
        redis_server.client.execute_command("CLIENT", "PAUSE", "300", "ALL")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await client.get("token:a")  # Redis does not answer: not waited on again
        assert await client.get("token:b") == "tenant-b"  # on a new connection
        clients = redis_server.client.execute_command("CLIENT", "LIST").splitlines()
        assert len(clients) == 2, clients  # the test's own and the new one, not the old
    finally:
        client.close()


async def test_a_lost_connection_fails_then_reconnects(redis_server: RedisServer) -> None:
    client = RedisClient(redis_server.url, password=None, connect_timeout_s=1.0)
    try:
        await client.set("token:c", "tenant-c", px=60_000)
        redis_server.client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        await asyncio.sleep(0.1)
        assert await client.get("token:c") == "tenant-c"  # a new connection
        redis_server.stop()
        with pytest.raises(OSError):
            await client.get("token:c")
    finally:
        client.close()


async def test_password_and_database(redis_server: RedisServer) -> None:
    redis_server.client.config_set("requirepass", "s3cret")
    redis_server.client.execute_command("AUTH", "s3cret")
    url = redis_server.url.removesuffix("/0") + "/3"
    without = RedisClient(url, password=None, connect_timeout_s=1.0)
    with pytest.raises(RedisReplyError, match="NOAUTH"):
        await without.get("token:d")
    without.close()
    client = RedisClient(url, password="s3cret", connect_timeout_s=1.0)
    try:
        await client.set("token:d", "tenant-d", px=60_000)
        redis_server.client.execute_command("SELECT", "3")
        assert redis_server.client.get("token:d") == "tenant-d"
    finally:
        client.close()
        redis_server.client.config_set("requirepass", "")
