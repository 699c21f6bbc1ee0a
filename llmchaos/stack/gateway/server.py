"""The gateway's HTTP side: handlers, error handling and the process's lifecycle.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (these need a bearer
token), GET /healthz (200 whenever the gateway runs, with healthy worker counts: it is what
HAProxy checks, and a gateway is not broken because its workers are), GET /health and
GET /version (vLLM's: 200 with an empty body; the version) and GET /metrics. Every response
carries `X-Gateway`; responses a worker answered carry `X-Serving-Mode` and `X-Worker`. Errors
are OpenAI error bodies with a code, never a traceback: a client's mistake (body, header,
type, encoding, malformed HTTP) is always a 4xx (openai_api.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sqlite3
import time

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from llmchaos.errors import StackError
from llmchaos.stack.gateway.auth import TokenAuthenticator, TokenDb
from llmchaos.stack.gateway.degradation import Degradation
from llmchaos.stack.gateway.discovery import Discovery
from llmchaos.stack.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from llmchaos.stack.gateway.proxy import Proxy
from llmchaos.stack.gateway.routing import WorkerPool
from llmchaos.stack.openai_api import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MAX_BODY_BYTES,
    VERSION,
    ApiError,
    OpenAIAppRunner,
    error_response,
    http_error,
    parse_generation_request,
)
from llmchaos.stack.settings import GatewaySettings

__all__ = ["Gateway"]

log = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 0.15
"""Grace for in-flight requests at stop; short, since HAProxy retries on the other gateway."""
_CLIENT_CLOSED_STATUS = 499
"""Status recorded (never sent) for a request whose client went away, as nginx logs it."""
_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")
"""RFC 6750's b64token: anything else (spaces, non-ASCII, undecodable bytes) is no token."""


class Gateway:
    """One API gateway: `await start()`, serve, `await stop()`."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.pool = WorkerPool(settings)
        self.metrics = GatewayMetrics(self.pool)
        self.degradation = Degradation(
            settings.degradation,
            lambda: [(w.name, w.health_url.with_path("/metrics")) for w in self.pool.workers],
            self.metrics.registry,
            settings.retry_after_s,
        )
        self._db = TokenDb(settings, self.metrics)
        self._auth = TokenAuthenticator(settings, self._db, self.metrics)
        self._models = tuple(settings.models)
        self._models_body = {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "llmchaos"}
                for m in settings.models
            ],
        }
        self._session: aiohttp.ClientSession | None = None
        self._proxy: Proxy | None = None
        self._runner: web.AppRunner | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._degradation_task: asyncio.Task[None] | None = None
        self.discovery = (
            Discovery(settings.discovery, self.pool, self.metrics.registry)
            if settings.discovery.endpoints
            else None
        )
        self._discovery_task: asyncio.Task[None] | None = None
        self.port = settings.port
        """Bound port (the real one when settings.port is 0)."""

    async def start(self) -> None:
        """Open the token table, check the workers once, and listen.

        Raises StackError if the token table cannot be read or the address cannot be bound.
        """
        self._db.open()
        # one session for every upstream: its connector keeps a keep-alive pool per worker
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._proxy = Proxy(self.settings, self.pool, self.metrics, self._session)
        # a first round before listening, so a fresh gateway does not 503 for one interval
        if self.discovery is not None:
            await self.discovery.poll(self._session)
            self._discovery_task = asyncio.create_task(self.discovery.run(self._session))
        await self.pool.check_all(self._session)
        self._health_task = asyncio.create_task(self.pool.run_health_checks(self._session))
        self._degradation_task = asyncio.create_task(self.degradation.run(self._session))
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY_BYTES)
        app.router.add_post(CHAT_PATH, self._chat_completions)
        app.router.add_post(COMPLETIONS_PATH, self._completions)
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.on_response_prepare.append(self._add_gateway_header)
        self.degradation.install(app)
        self._runner = OpenAIAppRunner(
            app,
            access_log=None,
            handler_cancellation=True,  # a client that goes away cancels its upstream request
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port, backlog=1024)
        try:
            await site.start()
        except OSError as exc:
            await self.stop()
            raise StackError(
                f"gateway {self.settings.name}: cannot listen on "
                f"{self.settings.host}:{self.settings.port}: {exc}"
            ) from exc
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Stop listening and release every connection, pool and thread."""
        for task in (self._health_task, self._degradation_task, self._discovery_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        await self._auth.close()
        self._db.close()

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT_PATH)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETIONS_PATH)

    async def _generate(self, request: web.Request, path: str) -> web.StreamResponse:
        started_s = time.perf_counter()
        mode = "none"
        status = 500
        try:
            tenant = await self._authenticate(request)
            try:
                body = await request.read()
            except web.HTTPException as exc:  # over client_max_size: 413
                raise http_error(exc, request) from None
            generation = parse_generation_request(body, self._models, path == CHAT_PATH)
            self._admit()
            body = self.degradation.admit(request, generation, body)
            assert self._proxy is not None
            response, mode = await self._proxy.forward(
                request,
                path,
                body,
                generation.stream,
                tenant,
                sum(generation.prompt_tokens),
                self.degradation.output_tokens(request, generation),
            )
            status = response.status
            return response
        except ApiError as exc:
            status = exc.status
            return error_response(exc)
        except asyncio.CancelledError:
            status = _CLIENT_CLOSED_STATUS
            self.metrics.client_disconnects.inc()
            raise
        finally:
            self.metrics.observe_request(mode, status, time.perf_counter() - started_s)

    async def _authenticate(self, request: web.Request) -> str:
        """The tenant of the request's bearer token.

        Raises ApiError 401 `invalid_api_key`, or 503 when the token table cannot be read.
        """
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(
                401,
                "Missing bearer token: send 'Authorization: Bearer <token>'",
                code="invalid_api_key",
            )
        if not _TOKEN.fullmatch(token):
            raise ApiError(
                401,
                "Malformed bearer token: a token is letters, digits and -._~+/ (RFC 6750)",
                code="invalid_api_key",
            )
        try:
            tenant = await self._auth.tenant_for(token)
        except sqlite3.Error as exc:
            log.error("token lookup failed: %s", exc)
            raise ApiError(
                503, "token store unavailable", type="server_error", code="auth_unavailable"
            ) from None
        if tenant is None:
            raise ApiError(
                401,
                f"Incorrect or revoked API key provided: {token[:4]}***",
                code="invalid_api_key",
            )
        return tenant

    def _admit(self) -> None:
        """Raises ApiError 429 `rate_limit_exceeded` when the estimated queue is too long, or
        when only the CPU fallback is left and it is full (routing.py's rules)."""
        queue = self.pool.estimated_queue()
        threshold = self.settings.queue_shed_threshold
        if queue > threshold:
            reason = f"estimated queue {queue} > {threshold}"
        elif self.pool.cpu_fallback_full():
            reason = "no GPU worker is available and the CPU fallback is full"
        else:
            return
        retry_after_s = self.settings.retry_after_s
        raise ApiError(
            429,
            f"Gateway overloaded: {reason}; retry after {retry_after_s} s",
            type="requests",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s)},
        )

    async def _list_models(self, request: web.Request) -> web.Response:
        await self._authenticate(request)
        return web.json_response(self._models_body)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "name": self.settings.name,
                "healthy_workers": self.pool.healthy_counts(),
                "estimated_queue": self.pool.estimated_queue(),
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _add_gateway_header(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Gateway"] = self.settings.name

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Turn every error into an OpenAI error body; log the unexpected ones."""
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(http_error(exc, request))
        except Exception:
            log.exception("unexpected error in %s %s", request.method, request.path)
            return error_response(
                ApiError(500, "internal gateway error", type="server_error", code="internal_error")
            )
