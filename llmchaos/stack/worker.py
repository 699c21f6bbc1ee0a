"""The engine worker: an OpenAI-compatible aiohttp server over one simulated engine.

    python -m llmchaos.stack.worker --settings PATH     (WorkerSettings JSON, see write_settings)

Endpoints: POST /v1/chat/completions (plain and SSE), GET /v1/models, GET /healthz (503
`loading` for `profile.load_s` after start, the port already listening), GET /metrics (vLLM's
metric names), GET /gpu/processes (nvidia-smi's view: this process holds the GPU). Every
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
from llmchaos.stack.engine import Engine, EngineStopped, SequenceResult, check_profile
from llmchaos.stack.openai_api import ApiError, ChatRequest, error_response, parse_chat_request
from llmchaos.stack.settings import WorkerSettings, load_settings
from llmchaos.stack.tokens import count_tokens, make_text

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

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(settings: WorkerSettings) -> web.Application:
    """The aiohttp application of one worker; the engine starts with the app.

    Raises InvalidInput (at startup) for an engine profile the engine cannot run.
    """
    app = web.Application(middlewares=[_openai_errors], client_max_size=16 * 1024 * 1024)
    app.on_startup.append(lambda app: _start(app, settings))
    app.on_shutdown.append(_stop)
    headers = {"X-Serving-Mode": settings.profile.mode, "X-Worker": settings.name}

    async def add_headers(_request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(headers)

    app.on_response_prepare.append(add_headers)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/gpu/processes", _gpu_processes)
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


async def _stop(app: web.Application) -> None:
    # Runs before aiohttp waits for in-flight handlers: aborting their sequences lets them end.
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
        error = ApiError(
            exc.status,
            f"{request.method} {request.path}: {exc.reason}",
            code=exc.reason.lower().replace(" ", "_"),
        )
        request.app[_WORKER].metrics.count_error(error)
        allow = exc.headers.get("Allow")  # the one header of aiohttp's worth keeping (405)
        return error_response(error, headers={"Allow": allow} if allow else None)
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        error = ApiError(500, "internal error in the engine worker", type="internal_server_error")
        request.app[_WORKER].metrics.count_error(error)
        return error_response(error)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
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
    chat = parse_chat_request(await request.read(), (worker.settings.model,))
    prompt_tokens = count_tokens(chat.prompt_text)
    limit = worker.settings.profile.max_model_len
    requested = prompt_tokens + chat.max_tokens
    if requested > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{requested} tokens ({prompt_tokens} in the messages, {chat.max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            code="context_length_exceeded",
            param="messages",
        )
    try:
        if chat.stream:
            return await _stream(request, worker, chat, prompt_tokens)
        return await _complete(worker, chat, prompt_tokens)
    except EngineStopped:
        raise _stopping(worker) from None


def _stopping(worker: _Worker) -> ApiError:
    return ApiError(
        503,
        f"worker {worker.settings.name} is shutting down",
        type="service_unavailable",
        code="worker_stopping",
    )


def _usage(result: SequenceResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


async def _complete(worker: _Worker, chat: ChatRequest, prompt_tokens: int) -> web.Response:
    seq = worker.engine.submit(prompt_tokens, chat.max_tokens)
    try:
        result = await seq
    finally:
        seq.abort()  # no-op once done; frees the KV if this handler is cancelled
    if result.finish_reason == "abort":
        raise _stopping(worker)
    worker.metrics.observe(result)
    body = {
        "id": f"chatcmpl-{worker.settings.name}-{seq.seq_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": chat.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": make_text(result.completion_tokens)},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": _usage(result),
    }
    return web.Response(body=json.dumps(body).encode(), content_type="application/json")


async def _stream(
    request: web.Request, worker: _Worker, chat: ChatRequest, prompt_tokens: int
) -> web.StreamResponse:
    seq = worker.engine.submit(prompt_tokens, chat.max_tokens, stream=True)
    head = {
        "id": f"chatcmpl-{worker.settings.name}-{seq.seq_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": chat.model,
    }

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + json.dumps({**head, "choices": choices, **extra}).encode() + b"\n\n"

    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await response.prepare(request)
        await response.write(event([{"index": 0, "delta": {"role": "assistant", "content": ""}}]))
        sent = 0
        async for n_tokens in seq.tokens():
            # A leading space between chunks keeps the joined text at one word per token.
            text = make_text(n_tokens, sent) if sent == 0 else " " + make_text(n_tokens, sent)
            sent += n_tokens
            await response.write(event([{"index": 0, "delta": {"content": text}}]))
        result = await seq
        if result.finish_reason == "abort":
            await response.write(b"data: " + json.dumps(_stopping(worker).body()).encode())
            await response.write(b"\n\n" + _SSE_DONE)
            return response
        worker.metrics.observe(result)
        usage = _usage(result)
        await response.write(
            event([{"index": 0, "delta": {}, "finish_reason": "length"}], usage=usage)
        )
        if chat.include_usage:
            await response.write(event([], usage=usage))
        await response.write(_SSE_DONE)
        await response.write_eof()
    except ConnectionResetError:
        log.debug("client of sequence %d went away mid-stream", seq.seq_id)
    finally:
        seq.abort()  # no-op once done; a vanished client must not keep its KV
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
    runner = web.AppRunner(
        make_app(settings),
        handle_signals=False,
        access_log=None,
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
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s worker[%(process)d] %(name)s: %(message)s",
    )
    try:
        settings = load_settings(WorkerSettings, args.settings)
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
