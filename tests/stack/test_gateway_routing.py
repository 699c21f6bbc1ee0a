"""Gateway routing: load spreading, health, retries, CPU fallback and load shedding."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from llmchaos.stack.gateway.routing import WorkerPool
from llmchaos.stack.settings import GatewaySettings, UpstreamWorker
from tests.stack import gateway_fixtures as fx
from tests.stack.gateway_fixtures import (
    FakeUpstream,
    GatewayClient,
    RedisServer,
    gateway_settings,
    never_accepting_listener,
    refusing_worker,
    running_gateway,
    wait_for,
)

redis_server = fx.redis_server
token_db = fx.token_db
upstreams = fx.upstreams

Upstreams = Callable[..., Awaitable[FakeUpstream]]
REQUESTS = "llmchaos_gateway_requests_total"
RETRIES = "llmchaos_gateway_upstream_retries_total"


def _settings(
    redis_server: RedisServer,
    token_db: Path,
    workers: list[FakeUpstream | UpstreamWorker],
    **overrides: Any,
) -> GatewaySettings:
    upstream = [w.upstream() if isinstance(w, FakeUpstream) else w for w in workers]
    return gateway_settings(redis_server, token_db, upstream, **overrides)


async def _held(fakes: list[FakeUpstream], total: int) -> None:
    async def reached() -> bool:
        return sum(f.in_flight for f in fakes) == total

    await wait_for(reached, 3.0, f"{total} requests held by the fake workers")


async def _healthy(gw: GatewayClient, gpu: int, cpu: int = 0) -> None:
    """Wait for the workers' health: a gateway starts with a check of each, but on a busy
    machine that first check can time out (0.5 s), and requests sent then get 503."""

    async def reached() -> bool:
        return await gw.healthy() == {"gpu": gpu, "cpu": cpu}

    await wait_for(reached, 3.0, f"{gpu} healthy gpu and {cpu} cpu worker(s)")


@pytest.mark.asyncio
async def test_idle_workers_take_turns(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    a, b = await upstreams("gpu-0"), await upstreams("gpu-1")
    async with running_gateway(_settings(redis_server, token_db, [a, b])) as gw:
        await _healthy(gw, gpu=2)
        for _ in range(10):
            assert (await gw.chat())[0] == 200
    assert (len(a.received), len(b.received)) == (5, 5)


@pytest.mark.asyncio
async def test_concurrent_requests_go_to_the_least_outstanding_worker(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    a, b = await upstreams("gpu-0"), await upstreams("gpu-1")
    a.hold = b.hold = asyncio.Event()
    async with running_gateway(_settings(redis_server, token_db, [a, b])) as gw:
        await _healthy(gw, gpu=2)
        replies = [asyncio.ensure_future(gw.chat()) for _ in range(3)]
        await _held([a, b], 3)
        busier, idler = (a, b) if a.in_flight > b.in_flight else (b, a)
        assert (busier.in_flight, idler.in_flight) == (2, 1)
        replies += [asyncio.ensure_future(gw.chat()) for _ in range(3)]
        await _held([a, b], 6)
        assert (busier.in_flight, idler.in_flight) == (3, 3)
        a.hold.set()
        assert [r[0] for r in await asyncio.gather(*replies)] == [200] * 6


@pytest.mark.parametrize("failure", ["refuse", "connect_hang", "first_byte_hang", "http_500"])
@pytest.mark.asyncio
async def test_failing_worker_is_retried_elsewhere_and_ejected(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams, failure: str
) -> None:
    bad, good = await upstreams("gpu-0"), await upstreams("gpu-1")
    # one active check at start only, so what routes around `bad` is the passive ejection
    settings = _settings(
        redis_server, token_db, [bad, good], health_interval_s=60.0, first_byte_timeout_s=0.5
    )
    async with running_gateway(settings) as gw, _break(bad, failure):
        replies = []
        for _ in range(4):
            started = time.monotonic()
            status, headers, _ = await gw.chat()
            replies.append((status, headers["X-Worker"], time.monotonic() - started))
        text = await gw.metrics()
        assert await gw.healthy() == {"gpu": 1, "cpu": 0}
    assert [(s, w) for s, w, _ in replies] == [(200, "gpu-1")] * 4, replies
    assert fx.metric_value(text, RETRIES) == 1
    assert fx.metric_value(text, REQUESTS, mode="gpu", code="200") == 4
    slowest_s = max(s for _, _, s in replies)
    if failure == "connect_hang":
        assert 0.3 <= slowest_s < 1.0, replies  # connect_timeout_s, then the retry
    if failure == "first_byte_hang":
        assert 0.5 <= slowest_s < 1.2, replies  # first_byte_timeout_s, then the retry
        assert bad.cancelled == 1  # the hung upstream request was given up, not leaked


class _break:
    """Make `fake` fail the way `failure` says while the block runs."""

    def __init__(self, fake: FakeUpstream, failure: str) -> None:
        self._fake = fake
        self._failure = failure
        self._listener: Any = None

    async def __aenter__(self) -> None:
        if self._failure == "http_500":
            self._fake.behaviour = "fail"
        elif self._failure == "first_byte_hang":
            self._fake.behaviour = "hang"
        else:
            port = self._fake.port
            await self._fake.stop()
            if self._failure == "connect_hang":
                self._listener = never_accepting_listener(port)
                self._listener.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        if self._listener is not None:
            self._listener.__exit__(None, None, None)


@pytest.mark.parametrize(
    ("failure", "status"), [("refuse", 502), ("connect_hang", 504), ("http_500", 500)]
)
@pytest.mark.asyncio
async def test_without_failover_a_failing_worker_keeps_its_share_and_is_not_retried(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams, failure: str, status: int
) -> None:
    bad, good = await upstreams("gpu-0"), await upstreams("gpu-1")
    # one active check at start only: after its first failure `bad` stays ejected for 30 s
    settings = _settings(
        redis_server, token_db, [bad, good], health_interval_s=60.0, failover=False
    )
    async with running_gateway(settings) as gw, _break(bad, failure):
        statuses = [(await gw.chat())[0] for _ in range(4)]
        assert await gw.healthy() == {"gpu": 1, "cpu": 0}  # it knows, and sends there anyway
        text = await gw.metrics()
    # round-robin: every other request goes to the ejected worker and fails as it failed
    assert sorted(statuses) == [200, 200, status, status], statuses
    assert statuses[0] == statuses[2] != statuses[1] == statuses[3], statuses
    assert len(good.received) == 2
    assert fx.metric_value(text, RETRIES) == 0
    assert fx.metric_value(text, "llmchaos_gateway_upstream_failures_total", worker="gpu-0") == 2


@pytest.mark.asyncio
async def test_without_failover_dead_and_loading_gpus_get_traffic_and_cpu_none(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    loading, cpu = await upstreams("gpu-1"), await upstreams("cpu-0", mode="cpu")
    loading.health_status, loading.health_state = 503, "loading"
    workers = [refusing_worker("gpu-0"), loading, cpu]
    async with running_gateway(_settings(redis_server, token_db, workers, failover=False)) as gw:
        assert await gw.healthy() == {"gpu": 0, "cpu": 1}  # with failover: all to cpu-0
        replies = [await gw.chat() for _ in range(4)]
    # the fake answers chat while reporting loading; a real worker answers 503 model_loading
    assert sorted((s, h.get("X-Worker")) for s, h, _ in replies) == [
        (200, "gpu-1"),
        (200, "gpu-1"),
        (502, None),
        (502, None),
    ]
    assert cpu.received == []


@pytest.mark.asyncio
async def test_worker_failing_everywhere_returns_its_error_with_mode(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    fake = await upstreams("gpu-0")
    fake.behaviour = "fail"
    async with running_gateway(_settings(redis_server, token_db, [fake])) as gw:
        status, headers, body = await gw.chat()
    assert status == 500
    assert headers["X-Serving-Mode"] == "gpu"
    assert body["error"]["message"] == "boom"


@pytest.mark.asyncio
async def test_ejected_worker_is_readmitted_by_a_passing_active_check(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    # refused, then back (restarted by its node agent): not a bad answer, so the first
    # passing check readmits it (a 500 would keep it out: see the Xid test)
    a, b = await upstreams("gpu-0"), await upstreams("gpu-1")
    async with running_gateway(_settings(redis_server, token_db, [a, b], eject_s=60.0)) as gw:
        await _healthy(gw, gpu=2)
        ports = a.port, b.port
        await a.stop()
        await b.stop()
        assert (await gw.chat())[0] in (502, 503)  # refused, or known down already
        await _healthy(gw, gpu=0)
        await a.start(ports[0])
        await b.start(ports[1])
        started = time.monotonic()
        await _healthy(gw, gpu=2)
        readmitted_s = time.monotonic() - started
        assert (await gw.chat())[0] == 200
    assert readmitted_s < 1.0  # one health interval (0.1 s), not eject_s (60 s)


@pytest.mark.asyncio
async def test_loading_worker_gets_no_traffic_until_ready(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    loading, ready = await upstreams("gpu-0"), await upstreams("gpu-1")
    loading.health_status, loading.health_state = 503, "loading"
    async with running_gateway(_settings(redis_server, token_db, [loading, ready])) as gw:
        assert await gw.healthy() == {"gpu": 1, "cpu": 0}
        for _ in range(4):
            assert (await gw.chat())[0] == 200
        assert loading.received == []
        loading.health_status, loading.health_state = 200, "ready"
        await _healthy(gw, gpu=2)
        for _ in range(4):
            assert (await gw.chat())[0] == 200
    assert len(loading.received) == 2


@pytest.mark.parametrize("max_tokens", [None, 64])
@pytest.mark.asyncio
async def test_cpu_fallback_serves_when_no_gpu_worker_is_up(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams, max_tokens: int | None
) -> None:
    """Long answers too (64 tokens, past cpu_spill_max_tokens): with no gpu worker healthy
    the cpu fallback takes every length."""
    cpu = await upstreams("cpu-0", mode="cpu")
    settings = _settings(redis_server, token_db, [refusing_worker(), cpu])
    body = fx.CHAT_BODY if max_tokens is None else {**fx.CHAT_BODY, "max_tokens": max_tokens}
    async with running_gateway(settings) as gw:
        status, headers, _ = await gw.chat(body=body)
        assert await gw.metric(REQUESTS, mode="cpu", code="200") == 1
    assert (status, headers["X-Serving-Mode"], headers["X-Worker"]) == (200, "cpu", "cpu-0")


@pytest.mark.asyncio
async def test_without_cpu_fallback_no_gpu_means_503(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    cpu = await upstreams("cpu-0", mode="cpu")
    settings = _settings(redis_server, token_db, [refusing_worker(), cpu], cpu_fallback=False)
    async with running_gateway(settings) as gw:
        status, headers, body = await gw.chat()
        assert await gw.metric(REQUESTS, mode="none", code="503") == 1
    assert status == 503
    assert body["error"]["type"] == "server_error"
    assert body["error"]["code"] == "no_healthy_upstream"
    assert "X-Serving-Mode" not in headers
    assert headers["X-Gateway"] == "gateway-test"
    assert cpu.received == []


@pytest.mark.parametrize(("cpu_fallback", "on_gpu", "on_cpu"), [(True, 2, 3), (False, 5, 0)])
@pytest.mark.asyncio
async def test_full_gpu_workers_spill_to_cpu_only_with_fallback(
    redis_server: RedisServer,
    token_db: Path,
    upstreams: Upstreams,
    cpu_fallback: bool,
    on_gpu: int,
    on_cpu: int,
) -> None:
    gpu, cpu = await upstreams("gpu-0", max_num_seqs=2), await upstreams("cpu-0", mode="cpu")
    gpu.hold = cpu.hold = asyncio.Event()
    settings = _settings(
        redis_server,
        token_db,
        [gpu, cpu],
        cpu_fallback=cpu_fallback,
        worker_queue_allowance_ratio=0.0,  # capacity = max_num_seqs = 2
    )
    async with running_gateway(settings) as gw:
        await _healthy(gw, gpu=1, cpu=1)
        replies = [asyncio.ensure_future(gw.chat()) for _ in range(5)]
        await _held([gpu, cpu], 5)
        assert (gpu.in_flight, cpu.in_flight) == (on_gpu, on_cpu)
        gpu.hold.set()
        modes = sorted(r[1]["X-Serving-Mode"] for r in await asyncio.gather(*replies))
    assert modes == ["cpu"] * on_cpu + ["gpu"] * on_gpu


@pytest.mark.asyncio
async def test_full_gpu_workers_spill_to_cpu_only_answers_it_can_finish_in_time(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    """The stepped_capacity timeouts (on the 2-GPU layout it had then): at 75 QPS of 64-token
    answers the gpu workers filled up and the next 16 requests went to cpu-0, which takes
    ~9.8 s for them (its batch of 16 at ~140 ms a token): all 16 got first_byte_timeout at
    6 s and their retry on a gpu worker ended past the clients' 8 s, while their neighbours
    queued on the gpu workers in ~1.7 s.
    A long answer waits on a full gpu worker instead; a short one still spills."""
    gpu, cpu = await upstreams("gpu-0", max_num_seqs=2), await upstreams("cpu-0", mode="cpu")
    gpu.hold = cpu.hold = asyncio.Event()
    settings = _settings(
        redis_server,
        token_db,
        [gpu, cpu],
        worker_queue_allowance_ratio=0.0,  # capacity = max_num_seqs = 2
        first_byte_timeout_s=5.0,  # the holds must not time out on a busy machine
        hedge_after_s=0.0,  # nor be hedged
    )
    long, short = {**fx.CHAT_BODY, "max_tokens": 64}, {**fx.CHAT_BODY, "max_tokens": 32}
    async with running_gateway(settings) as gw:
        await _healthy(gw, gpu=1, cpu=1)
        replies = [asyncio.ensure_future(gw.chat(body=long)) for _ in range(4)]
        await _held([gpu, cpu], 4)
        assert (gpu.in_flight, cpu.in_flight) == (4, 0)  # two of them queued on the full gpu
        replies.append(asyncio.ensure_future(gw.chat(body=short)))
        replies.append(asyncio.ensure_future(gw.chat()))  # no max_tokens: the default, 32
        await _held([gpu, cpu], 6)
        assert (gpu.in_flight, cpu.in_flight) == (4, 2)
        gpu.hold.set()
        modes = [r[1]["X-Serving-Mode"] for r in await asyncio.gather(*replies)]
    assert modes == ["gpu"] * 4 + ["cpu"] * 2


@pytest.mark.asyncio
async def test_queue_over_threshold_is_shed_with_429_and_retry_after(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    gpu = await upstreams("gpu-0", max_num_seqs=1)
    gpu.hold = asyncio.Event()
    settings = _settings(redis_server, token_db, [gpu], queue_shed_threshold=2)
    async with running_gateway(settings) as gw:
        await _healthy(gw, gpu=1)
        held = [asyncio.ensure_future(gw.chat()) for _ in range(4)]
        await _held([gpu], 4)
        async with gw.session.get("/healthz") as resp:
            assert (await resp.json())["estimated_queue"] == 3  # 4 outstanding - batch of 1
        status, headers, body = await gw.chat()
        gpu.hold.set()
        assert [r[0] for r in await asyncio.gather(*held)] == [200] * 4
        assert (await gw.chat())[0] == 200  # the queue drained: admitted again
        assert await gw.metric(REQUESTS, mode="none", code="429") == 1
    assert status == 429
    assert headers["Retry-After"] == "1"
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert len(gpu.received) == 5


@pytest.mark.asyncio
async def test_full_cpu_fallback_sheds_instead_of_queueing(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    cpu = await upstreams("cpu-0", mode="cpu", max_num_seqs=2)
    cpu.hold = asyncio.Event()
    settings = _settings(redis_server, token_db, [refusing_worker(), cpu])  # cpu: no queue
    async with running_gateway(settings) as gw:
        await _healthy(gw, gpu=0, cpu=1)
        held = [asyncio.ensure_future(gw.chat()) for _ in range(2)]
        await _held([cpu], 2)
        status, headers, body = await gw.chat()
        cpu.hold.set()
        assert [r[0] for r in await asyncio.gather(*held)] == [200, 200]
        assert (await gw.chat())[0] == 200  # capacity again: served from cpu
    assert (status, headers["Retry-After"]) == (429, "1")
    assert "CPU fallback is full" in body["error"]["message"]
    assert len(cpu.received) == 3


@pytest.mark.asyncio
async def test_health_check_timeouts_fail_a_worker_only_when_repeated(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    fake = await upstreams("gpu-0")
    # every 0.1 s, 0.3 s timeout, 2 timeouts in a row to fail: down 0.7-0.8 s after the hang
    async with running_gateway(_settings(redis_server, token_db, [fake])) as gw:
        fake.health_hang = True
        started = time.monotonic()
        await _healthy(gw, gpu=0)
        down_after_s = time.monotonic() - started
        fake.health_hang = False
        await _healthy(gw, gpu=1)
    assert 0.55 < down_after_s < 2.0, down_after_s


@pytest.mark.asyncio
async def test_a_worker_that_passes_checks_but_times_out_requests_stays_ejected(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    # a slow or lossy link: /healthz (tiny) gets through, requests time out. A check passing
    # while the request waited proves nothing, as after a bad answer: no readmission by it
    slow, good = await upstreams("gpu-0"), await upstreams("gpu-1")
    settings = _settings(
        redis_server, token_db, [slow, good], eject_s=30.0, first_byte_timeout_s=0.5
    )
    async with running_gateway(settings) as gw:
        await _healthy(gw, gpu=2)
        slow.behaviour = "hang"
        statuses = [(await gw.chat())[0] for _ in range(6)]
        await asyncio.sleep(0.5)  # several passing health checks (every 0.1 s) since
        assert await gw.healthy() == {"gpu": 1, "cpu": 0}
        statuses += [(await gw.chat())[0] for _ in range(6)]
    assert statuses == [200] * 12  # the one that timed out was retried on gpu-1
    assert slow.cancelled == 1, "one request went to the slow worker, then none"


@pytest.mark.asyncio
async def test_gray_ejections_stop_at_half_of_the_pool(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    """Both workers answer 500 while their checks pass (the whole pool sick): with
    max_ejection_ratio 0.5 (Envoy's max_ejection_percent) the first is ejected, the second
    kept, so the gateway still tries a worker instead of emptying the pool."""
    a, b = await upstreams("gpu-0"), await upstreams("gpu-1")
    settings = _settings(redis_server, token_db, [a, b], eject_s=30.0, max_ejection_ratio=0.5)
    async with running_gateway(settings) as gw:
        await _healthy(gw, gpu=2)
        a.behaviour = b.behaviour = "fail"
        statuses = [(await gw.chat())[0] for _ in range(4)]
        assert await gw.healthy() == {"gpu": 1, "cpu": 0}
        a.behaviour = b.behaviour = "ok"
        assert (await gw.chat())[0] == 200
    assert statuses == [500] * 4


LONG_PROMPT = {**fx.CHAT_BODY, "messages": [{"role": "user", "content": "word " * 200}]}
"""A prompt over the hedge tests' hedge_max_prompt_tokens (20): never hedged."""


@pytest.mark.asyncio
async def test_a_cpu_worker_outrun_by_a_gpu_twin_is_not_ejected(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    """A request spilled to cpu-0 while the gpu workers were full is hedged to a gpu worker
    that freed up meanwhile and answers at once. The fallback is slow by design, not an
    outlier among its peers: it stays in (ejected, it went out 5 or 6 times a stepped run)."""
    gpu0, gpu1 = await upstreams("gpu-0", max_num_seqs=1), await upstreams("gpu-1", max_num_seqs=1)
    cpu = await upstreams("cpu-0", mode="cpu")
    gpu0.hold, gpu1.hold, cpu.hold = asyncio.Event(), asyncio.Event(), asyncio.Event()
    settings = _settings(
        redis_server,
        token_db,
        [gpu0, gpu1, cpu],
        worker_queue_allowance_ratio=0.0,  # capacity = max_num_seqs = 1
        hedge_after_s=1.0,
        hedge_max_prompt_tokens=20,  # the gpu workers' held requests are never hedged
        first_byte_timeout_s=5.0,
    )
    async with running_gateway(settings) as gw:
        await _healthy(gw, gpu=2, cpu=1)
        held = [asyncio.ensure_future(gw.chat(body=LONG_PROMPT)) for _ in range(2)]
        await _held([gpu0, gpu1], 2)  # one on each gpu worker: both full
        spilled = asyncio.ensure_future(gw.chat())
        await _held([cpu], 1)
        gpu1.hold.set()  # gpu-1 frees up and answers at once: the twin, 1 s on, goes there
        status, headers, _ = await spilled
        assert (status, headers["X-Serving-Mode"]) == (200, "gpu")
        assert await gw.metric("llmchaos_gateway_hedged_requests_total", winner="hedge") == 1
        assert await gw.healthy() == {"gpu": 2, "cpu": 1}
        gpu0.hold.set()
        cpu.hold.set()
        await asyncio.gather(*held)


@pytest.mark.asyncio
async def test_a_gpu_worker_outrun_by_a_cpu_twin_is_ejected(
    redis_server: RedisServer, token_db: Path, upstreams: Upstreams
) -> None:
    """The other way round it is a gray failure: a gpu worker that sits on a short answer the
    cpu fallback gives within hedge_after_s is an outlier (a throttled GPU, a slow link)."""
    gpu, cpu = await upstreams("gpu-0"), await upstreams("cpu-0", mode="cpu")
    gpu.hold = asyncio.Event()
    settings = _settings(
        redis_server, token_db, [gpu, cpu], hedge_after_s=0.5, first_byte_timeout_s=5.0
    )
    async with running_gateway(settings) as gw:
        await _healthy(gw, gpu=1, cpu=1)
        status, headers, _ = await gw.chat()
        assert (status, headers["X-Serving-Mode"]) == (200, "cpu")
        assert await gw.healthy() == {"gpu": 0, "cpu": 1}
        gpu.hold.set()


def test_a_request_in_flight_at_an_ejection_does_not_renew_it() -> None:
    """A hung worker's requests time out one after another, for a first-byte timeout after
    its first one did. Each renewing the ejection kept it out that much past `eject_s`
    (gpu_hang's known-bad variant then looked recovered before the worker came back): only
    a request sent after the ejection ejects it again, during it or after its end."""
    hung = UpstreamWorker("gpu-0", "http://127.0.0.1:1", "gpu")
    pool = WorkerPool(GatewaySettings(workers=(hung,), eject_s=5.0))
    worker = pool.workers[0]
    worker.ready = True
    sent_before = time.monotonic() - 6.0
    pool.eject(worker, "first_byte_timeout", sent_at=sent_before)
    first_until = worker.ejected_until
    assert not worker.healthy(time.monotonic())
    time.sleep(0.01)
    pool.eject(worker, "first_byte_timeout", sent_at=sent_before + 0.5)
    assert worker.ejected_until == first_until
    worker.ejected_until = 0.0  # its ejection over (its time, or a passing check)
    pool.eject(worker, "first_byte_timeout", sent_at=sent_before + 1.0)
    assert worker.healthy(time.monotonic())
    pool.eject(worker, "first_byte_timeout", sent_at=time.monotonic())
    assert not worker.healthy(time.monotonic())
    assert worker.ejected_until > first_until
