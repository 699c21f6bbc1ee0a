"""The engine worker: an OpenAI-compatible aiohttp server over one simulated engine.

    python -m llmchaos.stack.worker --settings PATH     (WorkerSettings JSON, see write_settings)

Endpoints: POST /v1/chat/completions and /v1/completions (plain and SSE, vLLM's shapes: see
generation.py), GET /v1/models, GET /healthz (503 `loading` for `profile.load_s` after start,
the port already listening), GET /health (vLLM's: 200 empty once ready, 503 while loading),
GET /version, GET /metrics (vLLM's metric names), GET /gpu/processes (nvidia-smi's view: this
process holds the GPU), and the fault modes' control endpoints (llmchaos.stack.gpu_fault). Every
response carries `X-Serving-Mode` and `X-Worker`; every error is an OpenAI error body, never a
traceback. SIGTERM or SIGINT: stop listening, abort what runs, exit 0 within about a second.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmchaos.errors import InvalidInput, StackError
from llmchaos.stack.engine import Engine, EngineStopped, Sequence, SequenceResult, check_profile
from llmchaos.stack.generation import ChoicePlan, StreamChunks, completion_body, plan_choices
from llmchaos.stack.gpu_fault import GpuFault, add_fault_routes
from llmchaos.stack.openai_api import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_MAX_TOKENS,
    MAX_BODY_BYTES,
    VERSION,
    ApiError,
    GenerationRequest,
    OpenAIAppRunner,
    error_response,
    http_error,
    parse_generation_request,
)
from llmchaos.stack.settings import WorkerSettings, load_settings

__all__ = ["main", "make_app", "serve"]

log = logging.getLogger("llmchaos.stack.worker")

SHUTDOWN_GRACE_S = 0.5
"""How long in-flight handlers get after SIGTERM (their sequences are aborted first, so they
normally end at once); keeps the exit within about a second."""

TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""vLLM's buckets of vllm:time_to_first_token_seconds."""

E2E_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM's buckets of vllm:e2e_request_latency_seconds."""

_SSE_DONE = b"data: [DONE]\n\n"


class _EngineCollector(Collector):
    """Reads the engine's live figures at scrape time: nothing to update per step."""

    def __init__(self, engine: Engine, model: str) -> None:
        self._engine = engine
        self._model = model

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        labels = ["model_name"]
        value = [self._model]
        gauges = (
            ("vllm:num_requests_running", "Requests in the running batch.", stats.running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means full.", stats.kv_cache_usage),
        )
        for name, doc, number in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(value, number)
            yield gauge
        counters = (
            ("vllm:num_preemptions", "Preemptions.", stats.preemptions_total),
            ("vllm:prompt_tokens", "Prefilled prompt tokens.", stats.prompt_tokens_total),
            ("vllm:generation_tokens", "Generated tokens.", stats.generation_tokens_total),
        )
        for name, doc, number in counters:
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(value, number)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success",
            "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        success.add_metric([self._model, "length"], stats.finished_total)
        success.add_metric([self._model, "abort"], stats.aborted_total)
        yield success


class _Metrics:
    """The worker's Prometheus registry (one per process, never the global one)."""

    def __init__(self, engine: Engine, model: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model))
        ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            ["model_name"],
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            ["model_name"],
            buckets=E2E_BUCKETS_S,
            registry=self.registry,
        )
        self._errors = Counter(
            "llmchaos:worker_request_errors",
            "Requests answered with an error, by OpenAI error code (or type).",
            ["model_name", "code"],
            registry=self.registry,
        )
        self._model = model
        self.ttft_s = ttft.labels(model)
        self.e2e_s = e2e.labels(model)

    def observe(self, result: SequenceResult) -> None:
        if result.finish_reason != "length" or result.ttft_s is None:
            return
        self.ttft_s.observe(result.ttft_s)
        self.e2e_s.observe(result.e2e_s)

    def count_error(self, exc: ApiError) -> None:
        self._errors.labels(self._model, exc.code or exc.type).inc()


@dataclass
class _Worker:
    """What the handlers share; built at startup, inside the running loop."""

    settings: WorkerSettings
    engine: Engine
    metrics: _Metrics
    ready_at: float
    """loop.time() when the simulated model load is over."""
    created_unix_s: int

    def loading_left_s(self) -> float:
        return max(0.0, self.ready_at - asyncio.get_running_loop().time())


_WORKER = web.AppKey("worker", _Worker)
_GPU_FAULT = web.AppKey("gpu_fault", GpuFault)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(settings: WorkerSettings) -> web.Application:
    """The aiohttp application of one worker; the engine starts with the app.

    Raises InvalidInput (at startup) for an engine profile the engine cannot run.
    """
    app = web.Application(middlewares=[_openai_errors], client_max_size=MAX_BODY_BYTES)
    app.on_startup.append(lambda app: _start(app, settings))
    app.on_shutdown.append(_stop)
    headers = {"X-Serving-Mode": settings.profile.mode, "X-Worker": settings.name}

    async def add_headers(_request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(headers)

    app.on_response_prepare.append(add_headers)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/health", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/gpu/processes", _gpu_processes)
    add_fault_routes(app, _GPU_FAULT)
    return app


async def _start(app: web.Application, settings: WorkerSettings) -> None:
    engine = Engine(settings.profile)
    engine.start()
    loop = asyncio.get_running_loop()
    app[_WORKER] = _Worker(
        settings=settings,
        engine=engine,
        metrics=_Metrics(engine, settings.model),
        ready_at=loop.time() + settings.profile.load_s,
        created_unix_s=int(time.time()),
    )
    app[_GPU_FAULT] = GpuFault(engine)


async def _stop(app: web.Application) -> None:
    # Runs before aiohttp waits for in-flight handlers: aborting their sequences lets them end.
    app[_GPU_FAULT].close()
    await app[_WORKER].engine.close()


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        request.app[_WORKER].metrics.count_error(exc)
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = http_error(exc, request)
        request.app[_WORKER].metrics.count_error(error)
        return error_response(error)
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        error = ApiError(500, "internal error in the engine worker", type="internal_server_error")
        request.app[_WORKER].metrics.count_error(error)
        return error_response(error)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    worker = request.app[_WORKER]
    left_s = worker.loading_left_s()
    if left_s > 0:
        raise ApiError(
            503,
            f"worker {worker.settings.name} is loading the model, ready in {left_s:.1f} s",
            type="service_unavailable",
            code="model_loading",
            headers={"Retry-After": str(max(1, round(left_s)))},
        )
    generation = parse_generation_request(await request.read(), (worker.settings.model,), chat)
    prompt_tokens = generation.prompt_tokens
    max_tokens = _max_tokens(worker, generation, max(prompt_tokens))
    plans = plan_choices(generation, max_tokens)
    seqs: list[Sequence] = []
    try:
        for plan in plans:
            prompt = prompt_tokens[plan.prompt_index]
            seqs.append(worker.engine.submit(prompt, plan.tokens, stream=generation.stream))
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{worker.settings.name}-{seqs[0].seq_id}"
        fault = request.app[_GPU_FAULT]
        if generation.stream:
            return await _stream(request, worker, generation, request_id, plans, seqs, fault)
        response = await _complete(worker, generation, request_id, plans, seqs)
        if fault.breaks_inference:
            raise fault.error()
        return response
    except EngineStopped:
        raise _stopping(worker) from None
    finally:
        for seq in seqs:
            seq.abort()  # no-op once done; a vanished client must not keep its KV


def _max_tokens(worker: _Worker, generation: GenerationRequest, prompt_tokens: int) -> int:
    """The request's max_tokens, or the endpoint's default within the context window.

    Raises ApiError 400 `context_length_exceeded` when prompt and output do not fit.
    """
    limit = worker.settings.profile.max_model_len
    default = DEFAULT_MAX_TOKENS if generation.chat else DEFAULT_COMPLETION_MAX_TOKENS
    max_tokens = generation.max_tokens or max(1, min(default, limit - prompt_tokens))
    requested = prompt_tokens + max_tokens
    if requested > limit:
        where = "messages" if generation.chat else "prompt"
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{requested} tokens ({prompt_tokens} in the {where}, {max_tokens} in the "
            f"completion). Please reduce the length of the {where} or completion.",
            code="context_length_exceeded",
            param=where,
        )
    return max_tokens


def _stopping(worker: _Worker) -> ApiError:
    return ApiError(
        503,
        f"worker {worker.settings.name} is shutting down",
        type="service_unavailable",
        code="worker_stopping",
    )


async def _complete(
    worker: _Worker,
    generation: GenerationRequest,
    request_id: str,
    plans: list[ChoicePlan],
    seqs: list[Sequence],
) -> web.Response:
    results = [await seq for seq in seqs]
    if any(r.finish_reason == "abort" for r in results):
        raise _stopping(worker)
    for result in results:
        worker.metrics.observe(result)
    body = completion_body(
        generation,
        request_id,
        plans,
        sum(generation.prompt_tokens),
        sum(r.completion_tokens for r in results),
    )
    return web.Response(body=json.dumps(body).encode(), content_type="application/json")


async def _stream(
    request: web.Request,
    worker: _Worker,
    generation: GenerationRequest,
    request_id: str,
    plans: list[ChoicePlan],
    seqs: list[Sequence],
    fault: GpuFault,
) -> web.StreamResponse:
    chunks = StreamChunks(generation, request_id, sum(generation.prompt_tokens))
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    events: asyncio.Queue[tuple[int, int]] = asyncio.Queue()

    async def follow(k: int) -> None:
        async for n_tokens in seqs[k].tokens():
            events.put_nowait((k, n_tokens))
        events.put_nowait((k, 0))  # this sequence is over

    followers = [asyncio.ensure_future(follow(k)) for k in range(len(seqs))]
    sent = [0] * len(seqs)
    try:
        await response.prepare(request)
        open_seqs, started = len(seqs), False
        while open_seqs:
            k, n_tokens = await events.get()
            if n_tokens == 0:
                open_seqs -= 1
                continue
            out = b""
            if not started:  # vLLM's role chunks come with the first engine output
                out, started = chunks.first(plans), True
            out += chunks.tokens(plans[k], sent[k], sent[k] + n_tokens, request_id)
            sent[k] += n_tokens
            if out:
                await response.write(out)
            if fault.breaks_inference and request.transport is not None:
                request.transport.close()  # cut without the stream's end, as the engine died
                return response
        results = [await seq for seq in seqs]
        if any(r.finish_reason == "abort" for r in results):
            await response.write(b"data: " + json.dumps(_stopping(worker).body()).encode())
            await response.write(b"\n\n" + _SSE_DONE)
            return response
        for result in results:
            worker.metrics.observe(result)
        tail = chunks.usage(sum(sent)) if generation.include_usage else b""
        await response.write(tail + _SSE_DONE)
        await response.write_eof()
    except ConnectionResetError:
        log.debug("client of %s went away mid-stream", request_id)
    finally:
        for follower in followers:
            follower.cancel()
    return response


async def _models(request: web.Request) -> web.Response:
    worker = request.app[_WORKER]
    model = {
        "id": worker.settings.model,
        "object": "model",
        "created": worker.created_unix_s,
        "owned_by": "llmchaos",
        "max_model_len": worker.settings.profile.max_model_len,
    }
    return web.json_response({"object": "list", "data": [model]})


async def _health(request: web.Request) -> web.Response:
    """vLLM's liveness route: 200 with an empty body once the model serves (vLLM only
    listens then), 503 while it loads."""
    return web.Response(status=503 if request.app[_WORKER].loading_left_s() > 0 else 200)


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


async def _healthz(request: web.Request) -> web.Response:
    worker = request.app[_WORKER]
    settings = worker.settings
    body: dict[str, Any] = {
        "name": settings.name,
        "node": settings.node,
        "mode": settings.profile.mode,
        "max_num_seqs": settings.profile.max_num_seqs,
        "pid": os.getpid(),
    }
    left_s = worker.loading_left_s()
    if left_s > 0:
        return web.json_response(
            {"status": "loading", **body, "ready_in_s": round(left_s, 3)}, status=503
        )
    stats = worker.engine.stats()
    return web.json_response(
        {"status": "ready", **body, "running": stats.running, "waiting": stats.waiting}
    )


async def _metrics(request: web.Request) -> web.Response:
    registry = request.app[_WORKER].metrics.registry
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4}
    )


async def _gpu_processes(request: web.Request) -> web.Response:
    settings = request.app[_WORKER].settings
    if settings.profile.mode != "gpu":
        return web.json_response([])
    process = {
        "pid": os.getpid(),
        "process_name": sys.executable,
        "used_memory_mib": settings.profile.gpu_memory_mib,
        "gpu_index": settings.gpu_index,
    }
    return web.json_response([process])


async def serve(settings: WorkerSettings) -> None:
    """Serve until SIGTERM or SIGINT. Raises StackError when the address cannot be bound."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = OpenAIAppRunner(
        make_app(settings),
        handle_signals=False,
        access_log=None,
        # a client that goes away aborts its sequences (vLLM's with_cancellation): without
        # it, requests a timed-out client left behind keep their queue place and their KV
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_GRACE_S,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port, backlog=1024)
        try:
            await site.start()
        except OSError as exc:
            raise StackError(
                f"worker {settings.name}: cannot listen on {settings.host}:{settings.port}: {exc}"
            ) from exc
        log.info(
            "worker %s (%s, node %s) listening on %s:%d, ready in %.1f s",
            settings.name,
            settings.profile.mode,
            settings.node,
            settings.host,
            settings.port,
            settings.profile.load_s,
        )
        await stop.wait()
        log.info("worker %s stopping", settings.name)
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """CLI entry: exit 0 after a signal, 2 for bad settings, 1 when the stack part fails."""
    parser = argparse.ArgumentParser(prog="python -m llmchaos.stack.worker")
    parser.add_argument("--settings", required=True, type=Path, help="WorkerSettings JSON")
    parser.add_argument(
        "--restart", action="store_true", help="started again after a death: full model load"
    )
    # one settings file serves several workers of a profile (the hosts target's examples)
    parser.add_argument("--port", type=int, help="port to bind, instead of the file's")
    parser.add_argument("--name", help="worker name, instead of the file's")
    parser.add_argument("--node", help="node name, instead of the file's")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s worker[%(process)d] %(name)s: %(message)s",
    )
    try:
        settings = load_settings(WorkerSettings, args.settings)
        overrides = {"port": args.port, "name": args.name, "node": args.node}
        settings = dataclasses.replace(
            settings, **{k: v for k, v in overrides.items() if v is not None}
        )
        check_profile(settings.profile)
        if not args.restart and settings.profile.first_load_s is not None:
            profile = dataclasses.replace(settings.profile, load_s=settings.profile.first_load_s)
            settings = dataclasses.replace(settings, profile=profile)
    except InvalidInput as exc:
        print(f"llmchaos worker: {exc}", file=sys.stderr)
        return 2
    disable_created_metrics()  # vLLM exports no *_created series either
    try:
        uvloop.run(serve(settings))
    except StackError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
