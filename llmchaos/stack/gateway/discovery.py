"""Where the gateway's workers come from when they are not in its settings: the registry.

Every `interval_s` the gateway reads every key under `prefix` from the registry (etcd's v3
JSON API, a linearizable range: a member without a quorum, or without a leader during an
election, does not answer it), trying the members in turn, each within `timeout_s`. What it
finds becomes the worker pool (`WorkerPool.set_workers`: workers it knew keep their health and
load). When no member answers:

- `keep_last_known` (hardened): it goes on serving from the last workers it found, and says
  so once (`discovery: registry unreachable ...; serving the N workers last found`);
- otherwise (variant `no-endpoint-cache`): it drops them, as a client that trusts only a
  fresh answer, and answers 503 `no_healthy_upstream` until the registry is back.

Metrics: `llmchaos_gateway_discovery_reads_total{result}` (ok, failed),
`llmchaos_gateway_discovered_workers`, `llmchaos_gateway_discovery_age_seconds` (since the
last successful read).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from llmchaos.stack import etcd
from llmchaos.stack.gateway.routing import WorkerPool
from llmchaos.stack.settings import DiscoverySettings, UpstreamWorker

__all__ = ["Discovery"]

log = logging.getLogger("llmchaos.stack.gateway")


class _Unreachable(Exception):
    """No member answered the read."""


class Discovery:
    """The registry as the source of a gateway's workers: `poll()` once, `run()` as a task."""

    def __init__(
        self, settings: DiscoverySettings, pool: WorkerPool, registry: CollectorRegistry
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._body = json.dumps(etcd.prefix_range(settings.prefix)).encode()
        self._timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
        self._member = 0
        self._last_ok = time.monotonic()
        self._failing = False
        self._reads = Counter(
            "llmchaos_gateway_discovery_reads",
            "Reads of the registry, by result",
            ["result"],
            registry=registry,
        )
        for result in ("ok", "failed"):
            self._reads.labels(result=result)
        found = Gauge(
            "llmchaos_gateway_discovered_workers",
            "Workers the gateway routes to, as the registry last gave them (or kept)",
            registry=registry,
        )
        found.set_function(lambda: len(self._pool.workers))
        age = Gauge(
            "llmchaos_gateway_discovery_age_seconds",
            "Seconds since the last successful read of the registry",
            registry=registry,
        )
        age.set_function(lambda: time.monotonic() - self._last_ok)

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Read every interval until cancelled."""
        while True:
            started = time.monotonic()
            await self.poll(session)
            wait_s = self._settings.interval_s - (time.monotonic() - started)
            await asyncio.sleep(max(0.0, wait_s))

    async def poll(self, session: aiohttp.ClientSession) -> bool:
        """One read; the pool follows it. Returns whether the registry answered."""
        try:
            workers = await self._read(session)
        except _Unreachable as exc:
            self._reads.labels(result="failed").inc()
            if not self._failing:
                kept = len(self._pool.workers)
                action = (
                    f"serving the {kept} workers last found"
                    if self._settings.keep_last_known
                    else "dropping the workers it gave"
                )
                log.warning("discovery: registry unreachable (%s); %s", exc, action)
            self._failing = True
            if not self._settings.keep_last_known:
                self._pool.set_workers(())
            return False
        self._reads.labels(result="ok").inc()
        self._last_ok = time.monotonic()
        if self._failing:
            log.info("discovery: registry reachable again: %d worker(s)", len(workers))
        self._failing = False
        if {(w.name, w.url) for w in workers} != {(w.name, w.url) for w in self._pool.upstreams}:
            log.info("discovery: workers %s", ", ".join(w.name for w in workers) or "none")
        self._pool.set_workers(workers)
        return True

    async def _read(self, session: aiohttp.ClientSession) -> tuple[UpstreamWorker, ...]:
        endpoints = self._settings.endpoints
        problems = []
        for i in range(len(endpoints)):
            index = (self._member + i) % len(endpoints)
            url = endpoints[index] + "/v3/kv/range"
            try:
                async with session.post(url, data=self._body, timeout=self._timeout) as resp:
                    answer = await resp.json(content_type=None)
                if resp.status != 200 or not isinstance(answer, dict) or "error" in answer:
                    problems.append(f"{endpoints[index]}: HTTP {resp.status}")
                    continue
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                problems.append(f"{endpoints[index]}: {type(exc).__name__}")
                continue
            self._member = index
            return etcd.endpoints_of(answer)
        raise _Unreachable("; ".join(problems))
