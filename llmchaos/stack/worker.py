"""The engine worker: an OpenAI-compatible HTTP server (httpserver.py) over one simulated engine.

    python -m llmchaos.stack.worker --settings PATH     (WorkerSettings JSON, see write_settings)

Endpoints: POST /v1/chat/completions and /v1/completions (plain and SSE, vLLM's shapes: see
generation.py), GET /v1/models, GET /healthz (503 `loading` for `profile.load_s` after start,
the port already listening), GET /health (vLLM's: 200 empty once ready, 503 while loading),
GET /version, GET /metrics (vLLM's metric names), GET /gpu/processes (nvidia-smi's view: this
process holds the GPU), and the fault modes' control endpoints (llmchaos.stack.gpu_fault). Every
response carries `X-Serving-Mode` and `X-Worker`; every error is an OpenAI error body, never a
traceback. SIGTERM or SIGINT: drain for `shutdown_drain_s` (a pod's termination grace), then
abort what still runs and exit 0; a second signal cuts the drain short (when the stack goes
down the node agent SIGKILLs its workers: nothing routes there any more). Draining, the
worker first keeps serving while its health checks answer 503 `draining`, for `DEREGISTER_S`,
so the gateways drop it before its port closes (a pod's readiness failing before its preStop
sleep ends), then stops listening and lets what runs answer for the rest of the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import uvloop

from llmchaos.errors import InvalidInput, StackError
from llmchaos.stack.engine import Engine, EngineStopped, Sequence, check_profile
from llmchaos.stack.generation import ChoicePlan, StreamChunks, completion_body, plan_choices
from llmchaos.stack.gpu_fault import GpuFault, fault_routes
from llmchaos.stack.httpserver import Handler, HttpServer, Request, Responder, Response
from llmchaos.stack.openai_api import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_MAX_TOKENS,
    MAX_BODY_BYTES,
    VERSION,
    ApiError,
    GenerationRequest,
    api_error_for,
    error_answer,
    json_answer,
    parse_generation_request,
)
from llmchaos.stack.settings import WorkerSettings, load_settings
from llmchaos.stack.worker_metrics import CONTENT_TYPE, WorkerMetrics

__all__ = ["WorkerServer", "main", "serve"]

log = logging.getLogger("llmchaos.stack.worker")

DEREGISTER_S = 1.0
"""Of the drain, how long the worker still takes requests while its health checks say
`draining`: the gateways check every second and drop a worker at its first 503, so none is
sent to a closed port (a refused retry on a second worker scaled in at the same moment was a
5xx)."""

SHUTDOWN_GRACE_S = 0.5
"""How long handlers get once their sequences are aborted (after the drain); they normally
end at once."""

_INTERNAL_ERROR = ApiError(500, "internal error in the engine worker", type="internal_server_error")
"""The answer to an error of ours (its traceback goes to the log only)."""

_SSE_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"))


@dataclass
class _Worker:
    """What the handlers share; built at startup, inside the running loop."""

    settings: WorkerSettings
    engine: Engine
    metrics: WorkerMetrics
    fault: GpuFault
    ready_at: float
    """loop.time() when the simulated model load is over."""
    created_unix_s: int
    draining: bool = False
    """Set on SIGTERM: health checks answer 503 `draining`, requests are still served."""
    loaded: bool = False
    """Set by the first loading_left_s() after ready_at: later calls skip the clock."""

    def loading_left_s(self) -> float:
        if self.loaded:
            return 0.0
        left_s = self.ready_at - asyncio.get_running_loop().time()
        if left_s > 0:
            return left_s
        self.loaded = True
        return 0.0


class WorkerServer:
    """One engine worker: `port = await start()`, serve, `await stop()`.

    Raises InvalidInput (at start) for an engine profile the engine cannot run.
    """

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self._worker: _Worker | None = None
        self._server: HttpServer | None = None

    async def start(self) -> int:
        """Start the engine and listen; returns the bound port. Raises OSError when the
        address cannot be bound."""
        settings = self.settings
        engine = Engine(settings.profile)
        engine.start()
        worker = _Worker(
            settings=settings,
            engine=engine,
            metrics=WorkerMetrics(engine, settings.model),
            fault=GpuFault(engine),
            ready_at=asyncio.get_running_loop().time() + settings.profile.load_s,
            created_unix_s=int(time.time()),
        )
        self._worker = worker

        def route(handler: _WorkerHandler) -> Handler:
            return lambda request, responder: handler(worker, request, responder)

        routes: dict[str, dict[str, Handler]] = {
            "/v1/chat/completions": {"POST": route(_chat_completions)},
            "/v1/completions": {"POST": route(_completions)},
            "/v1/models": {"GET": route(_models)},
            "/healthz": {"GET": route(_healthz)},
            "/health": {"GET": route(_health)},
            "/version": {"GET": route(_version)},
            "/metrics": {"GET": route(_metrics)},
            "/gpu/processes": {"GET": route(_gpu_processes)},
            **fault_routes(worker.fault, json_answer),
        }
        self._server = HttpServer(
            routes,
            lambda exc, request: _on_error(worker, exc, request),
            headers=[("X-Serving-Mode", settings.profile.mode), ("X-Worker", settings.name)],
            max_body_bytes=MAX_BODY_BYTES,
        )
        try:
            return await self._server.start(settings.host, settings.port)
        except OSError:
            await self.stop()
            raise

    async def stop(self, drain_s: float = 0.0, hurry: asyncio.Event | None = None) -> None:
        """Drain for `drain_s` (module docstring; cut short once `hurry` is set): serve on
        while the health checks say draining, then stop listening and let what runs answer;
        then abort the rest (its handlers end at once), and close."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_s
        if self._worker is not None and self._server is not None and drain_s > 0:
            self._worker.draining = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(DEREGISTER_S, drain_s)):
                    await (hurry or asyncio.Event()).wait()
        if self._server is not None:
            self._server.close()
            left_s = deadline - loop.time()
            if left_s > 0:
                await self._server.wait_answered(left_s, hurry)
        if self._worker is not None:
            self._worker.fault.close()
            await self._worker.engine.close()
        if self._server is not None:
            await self._server.wait_closed(SHUTDOWN_GRACE_S)


_WorkerHandler = Callable[[_Worker, Request, Responder], Awaitable[Response | None]]


def _on_error(worker: _Worker, exc: BaseException, request: Request | None) -> Response:
    """Every error as an OpenAI error body, counted."""
    error = api_error_for(exc, request, _INTERNAL_ERROR, log)
    worker.metrics.count_error(error)
    return error_answer(error)


async def _chat_completions(
    worker: _Worker, request: Request, responder: Responder
) -> Response | None:
    return await _generate(worker, request, responder, chat=True)


async def _completions(worker: _Worker, request: Request, responder: Responder) -> Response | None:
    return await _generate(worker, request, responder, chat=False)


async def _generate(
    worker: _Worker, request: Request, responder: Responder, chat: bool
) -> Response | None:
    left_s = worker.loading_left_s()
    if left_s > 0:
        raise ApiError(
            503,
            f"worker {worker.settings.name} is loading the model, ready in {left_s:.1f} s",
            type="service_unavailable",
            code="model_loading",
            headers={"Retry-After": str(max(1, round(left_s)))},
        )
    generation = parse_generation_request(request.body, (worker.settings.model,), chat)
    prompt_tokens = generation.prompt_tokens
    max_tokens = _max_tokens(worker, generation, max(prompt_tokens))
    plans = plan_choices(generation, max_tokens)
    seqs: list[Sequence] = []
    try:
        for plan in plans:
            prompt = prompt_tokens[plan.prompt_index]
            seqs.append(worker.engine.submit(prompt, plan.tokens, stream=generation.stream))
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{worker.settings.name}-{seqs[0].seq_id}"
        if generation.stream:
            await _stream(request, responder, worker, generation, request_id, plans, seqs)
            return None
        response = await _complete(worker, generation, request_id, plans, seqs, sum(prompt_tokens))
        if worker.fault.breaks_inference:
            raise worker.fault.error()
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
    prompt_tokens: int,
) -> Response:
    results = [await seq for seq in seqs]
    if any(r.finish_reason == "abort" for r in results):
        raise _stopping(worker)
    for result in results:
        worker.metrics.observe(result)
    body = completion_body(
        generation,
        request_id,
        plans,
        prompt_tokens,
        sum(r.completion_tokens for r in results),
    )
    return Response(body=orjson.dumps(body))


async def _stream(
    request: Request,
    responder: Responder,
    worker: _Worker,
    generation: GenerationRequest,
    request_id: str,
    plans: list[ChoicePlan],
    seqs: list[Sequence],
) -> None:
    chunks = StreamChunks(generation, request_id, sum(generation.prompt_tokens))
    events: asyncio.Queue[tuple[int, int]] = asyncio.Queue()

    async def follow(k: int) -> None:
        async for n_tokens in seqs[k].tokens():
            events.put_nowait((k, n_tokens))
        events.put_nowait((k, 0))  # this sequence is over

    followers = [asyncio.ensure_future(follow(k)) for k in range(len(seqs))]
    sent = [0] * len(seqs)
    try:
        await responder.start(200, _SSE_HEADERS)
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
            await responder.write(out)
            if worker.fault.breaks_inference:
                request.transport.close()  # cut without the stream's end, as the engine died
                return
        results = [await seq for seq in seqs]
        if any(r.finish_reason == "abort" for r in results):
            await responder.write(b"data: " + json.dumps(_stopping(worker).body()).encode())
            await responder.write(b"\n\n" + _SSE_DONE)
            await responder.end()
            return
        for result in results:
            worker.metrics.observe(result)
        tail = chunks.usage(sum(sent)) if generation.include_usage else b""
        await responder.write(tail + _SSE_DONE)
        await responder.end()
    except ConnectionResetError:
        log.debug("client of %s went away mid-stream", request_id)
    finally:
        for follower in followers:
            follower.cancel()


async def _models(worker: _Worker, request: Request, responder: Responder) -> Response:
    model = {
        "id": worker.settings.model,
        "object": "model",
        "created": worker.created_unix_s,
        "owned_by": "llmchaos",
        "max_model_len": worker.settings.profile.max_model_len,
    }
    return json_answer({"object": "list", "data": [model]})


async def _health(worker: _Worker, request: Request, responder: Responder) -> Response:
    """vLLM's liveness route: 200 with an empty body once the model serves (vLLM only
    listens then), 503 while it loads or drains."""
    ready = worker.loading_left_s() <= 0 and not worker.draining
    return Response(200 if ready else 503, content_type="text/plain")


async def _version(worker: _Worker, request: Request, responder: Responder) -> Response:
    return json_answer({"version": VERSION})


async def _healthz(worker: _Worker, request: Request, responder: Responder) -> Response:
    settings = worker.settings
    body: dict[str, Any] = {
        "name": settings.name,
        "node": settings.node,
        "mode": settings.profile.mode,
        "max_num_seqs": settings.profile.max_num_seqs,
        "pid": os.getpid(),
    }
    if worker.draining:
        return json_answer({"status": "draining", **body}, 503)
    left_s = worker.loading_left_s()
    if left_s > 0:
        return json_answer({"status": "loading", **body, "ready_in_s": round(left_s, 3)}, 503)
    stats = worker.engine.stats()
    return json_answer(
        {"status": "ready", **body, "running": stats.running, "waiting": stats.waiting}
    )


async def _metrics(worker: _Worker, request: Request, responder: Responder) -> Response:
    return Response(body=worker.metrics.exposition(), content_type=CONTENT_TYPE)


async def _gpu_processes(worker: _Worker, request: Request, responder: Responder) -> Response:
    settings = worker.settings
    if settings.profile.mode != "gpu":
        return json_answer([])
    process = {
        "pid": os.getpid(),
        "process_name": sys.executable,
        "used_memory_mib": settings.profile.gpu_memory_mib,
        "gpu_index": settings.gpu_index,
    }
    return json_answer([process])


async def serve(settings: WorkerSettings) -> None:
    """Serve until SIGTERM or SIGINT, then drain (a second one cuts the drain short).
    Raises StackError when the address cannot be bound."""
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    server = WorkerServer(settings)
    try:
        try:
            await server.start()
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
        log.info("worker %s stopping (drain up to %g s)", settings.name, settings.shutdown_drain_s)
    finally:
        await server.stop(settings.shutdown_drain_s, hurry)


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
    try:
        uvloop.run(serve(settings))
    except StackError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
