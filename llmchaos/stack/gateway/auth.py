"""Bearer-token authentication: a Redis cache (`token:<token>`) over a SQLite token table.

The SQLite side stands for a networked database: a fixed pool of connections, each lookup
holding one for `token_db_latency_ms`. What happens when the cache empties at once is the
point of the chaos experiment behind it (seed article 3.2, P99 87 ms -> 1.2 s), so both
behaviours exist:

- hardened (CacheSettings defaults): TTL plus uniform jitter, negative entries for unknown or
  revoked tokens, and concurrent misses for one token sharing one lookup;
- naive: fixed TTL, no negative entries, one lookup per miss.

Redis down is never a 500: the lookup falls back to SQLite and Redis is skipped for
`redis_retry_s`, so an outage does not cost every request a connect timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import random
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from llmchaos.errors import StackError
from llmchaos.stack.gateway.metrics import GatewayMetrics
from llmchaos.stack.gateway.redis_client import RedisClient
from llmchaos.stack.settings import REDIS_PASSWORD_ENV, GatewaySettings

__all__ = ["KEY_PREFIX", "NEGATIVE_ENTRY", "TokenAuthenticator", "TokenDb"]

log = logging.getLogger(__name__)

KEY_PREFIX = "token:"
NEGATIVE_ENTRY = ""
"""Cached value of an unknown or revoked token (a tenant name is never empty)."""
_MAX_TOKEN_CHARS = 256
_LOOKUP_SQL = "SELECT tenant, revoked FROM tokens WHERE token = ?"


class TokenDb:
    """The SQLite token table behind a fixed-size connection pool.

    The executor has exactly as many threads as there are connections, so a thread never waits
    for a connection; a lookup waits in the executor queue instead, which is the pool wait.
    """

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self._path = Path(settings.token_db_path)
        self._pool_size = max(1, settings.token_db_pool_size)
        self._latency_s = settings.token_db_latency_ms / 1000.0
        self._metrics = metrics
        self._connections: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()
        self._executor = ThreadPoolExecutor(self._pool_size, thread_name_prefix="token-db")

    def open(self) -> None:
        """Open the pool's connections.

        Raises StackError if the file is missing or has no `tokens` table.
        """
        # mode=rw: a missing file is an error rather than a new empty table; not mode=ro,
        # which cannot open a WAL database whose -shm file is gone
        uri = self._path.absolute().as_uri() + "?mode=rw"
        for _ in range(self._pool_size):
            try:
                conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
                conn.execute(_LOOKUP_SQL, ("",)).fetchone()
            except sqlite3.Error as exc:
                self.close()
                raise StackError(
                    f"token_db_path {str(self._path)!r}: cannot read table tokens "
                    f"(token, tenant, revoked): {exc}"
                ) from exc
            self._connections.put(conn)

    def close(self) -> None:
        """Stop the pool without waiting for lookups still sleeping in their threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        while True:
            try:
                self._connections.get_nowait().close()
            except queue.Empty:
                return

    async def lookup(self, token: str) -> str | None:
        """The tenant of a valid token, None for an unknown or revoked one.

        Raises sqlite3.Error when the table cannot be read.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, self._lookup_blocking, token, time.perf_counter()
        )

    def _lookup_blocking(self, token: str, submitted_s: float) -> str | None:
        conn = self._connections.get()
        try:
            self._metrics.token_db_pool_wait.observe(time.perf_counter() - submitted_s)
            self._metrics.token_db_lookups.inc()
            if self._latency_s > 0:
                time.sleep(self._latency_s)  # the round trip, paid while holding the connection
            row = conn.execute(_LOOKUP_SQL, (token,)).fetchone()
        finally:
            self._connections.put(conn)
        if row is None or row[1] or not row[0]:
            return None
        return str(row[0])


class TokenAuthenticator:
    """Resolve bearer tokens to tenants through the cache and the token table."""

    def __init__(self, settings: GatewaySettings, db: TokenDb, metrics: GatewayMetrics) -> None:
        self._cache = settings.cache
        self._db = db
        self._metrics = metrics
        self._redis_retry_s = settings.redis_retry_s
        # one pipelined connection; no socket timeout: one asyncio.timeout per command, and
        # no retry: SQLite is the retry
        self._redis = RedisClient(
            settings.redis_url,
            password=os.environ.get(REDIS_PASSWORD_ENV) or None,
            connect_timeout_s=settings.redis_timeout_s,
        )
        self._redis_timeout_s = settings.redis_timeout_s
        self._skip_redis_until = 0.0
        self._inflight: dict[str, asyncio.Task[str | None]] = {}

    def close(self) -> None:
        """Close the Redis connection."""
        self._redis.close()

    async def tenant_for(self, token: str) -> str | None:
        """The tenant of `token`, None if it is unknown or revoked.

        Raises sqlite3.Error when the cache misses and the token table cannot be read.
        """
        if not token or len(token) > _MAX_TOKEN_CHARS:
            return None
        if time.monotonic() < self._skip_redis_until:
            self._metrics.cache_fallbacks.inc()
            return await self._resolve(token, write_back=False)
        try:
            async with asyncio.timeout(self._redis_timeout_s):
                cached = await self._redis.get(KEY_PREFIX + token)
        except (OSError, TimeoutError) as exc:
            self._redis_failed(exc)
            self._metrics.cache_fallbacks.inc()
            return await self._resolve(token, write_back=False)
        if cached is not None:
            if cached == NEGATIVE_ENTRY:
                self._metrics.cache_negative_hits.inc()
                return None
            self._metrics.cache_hits.inc()
            return str(cached)
        self._metrics.cache_misses.inc()
        return await self._resolve(token, write_back=True)

    async def _resolve(self, token: str, write_back: bool) -> str | None:
        if not self._cache.coalesce_misses:
            return await self._lookup(token, write_back)
        task = self._inflight.get(token)
        if task is None:
            # a task of its own, so that one waiter's cancellation does not cancel the others
            task = asyncio.ensure_future(self._lookup(token, write_back))
            self._inflight[token] = task
            task.add_done_callback(partial(self._forget, token))
        else:
            self._metrics.cache_coalesced.inc()
        return await asyncio.shield(task)

    def _forget(self, token: str, task: asyncio.Task[str | None]) -> None:
        self._inflight.pop(token, None)
        if not task.cancelled():
            task.exception()  # retrieved here in case every waiter went away

    async def _lookup(self, token: str, write_back: bool) -> str | None:
        try:
            tenant = await self._db.lookup(token)
        except sqlite3.Error:
            self._metrics.token_db_errors.inc()
            raise
        if write_back:
            await self._store(token, tenant)
        return tenant

    async def _store(self, token: str, tenant: str | None) -> None:
        if tenant is None:
            ttl_s = self._cache.negative_ttl_s
            if ttl_s <= 0:
                return
        else:
            ttl_s = self._cache.ttl_s + random.uniform(0.0, self._cache.ttl_jitter_s)
        try:
            async with asyncio.timeout(self._redis_timeout_s):
                await self._redis.set(
                    KEY_PREFIX + token,
                    NEGATIVE_ENTRY if tenant is None else tenant,
                    px=max(1, int(ttl_s * 1000)),
                )
        except (OSError, TimeoutError) as exc:
            self._redis_failed(exc)

    def _redis_failed(self, exc: BaseException) -> None:
        if time.monotonic() >= self._skip_redis_until:
            log.warning(
                "redis unavailable (%s: %s); authenticating from SQLite for %.1f s",
                type(exc).__name__,
                exc,
                self._redis_retry_s,
            )
        self._skip_redis_until = time.monotonic() + self._redis_retry_s
