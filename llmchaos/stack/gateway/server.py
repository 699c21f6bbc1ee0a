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

from llmchaos.errors import StackError
from llmchaos.stack.gateway.auth import TokenAuthenticator, TokenDb
from llmchaos.stack.gateway.degradation import DEGRADED_HEADERS, Degradation
from llmchaos.stack.gateway.discovery import Discovery
from llmchaos.stack.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from llmchaos.stack.gateway.proxy import Proxy
from llmchaos.stack.gateway.routing import WorkerPool
from llmchaos.stack.gateway.upstream import UpstreamPool
from llmchaos.stack.httpserver import HttpServer, Request, Responder, Response
from llmchaos.stack.openai_api import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MAX_BODY_BYTES,
    VERSION,
    ApiError,
    api_error_for,
    error_answer,
    json_answer,
    parse_generation_request,
)
from llmchaos.stack.settings import GatewaySettings

__all__ = ["Gateway"]

log = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 0.15
"""Grace for in-flight requests at stop; short, since HAProxy retries on the other gateway."""
_INTERNAL_ERROR = ApiError(
    500, "internal gateway error", type="server_error", code="internal_error"
)
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
        self._upstream: UpstreamPool | None = None
        self._server: HttpServer | None = None
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
        # health checks, discovery and the engines' /metrics (proxied requests: UpstreamPool)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._upstream = UpstreamPool(
            self.settings.connect_timeout_s, self.settings.stream_idle_timeout_s
        )
        self._proxy = Proxy(self.settings, self.pool, self.metrics, self._upstream)
        # a first round before listening, so a fresh gateway does not 503 for one interval
        if self.discovery is not None:
            await self.discovery.poll(self._session)
            self._discovery_task = asyncio.create_task(self.discovery.run(self._session))
        await self.pool.check_all(self._session)
        self._health_task = asyncio.create_task(self.pool.run_health_checks(self._session))
        self._degradation_task = asyncio.create_task(self.degradation.run(self._session))
        # a client that goes away cancels its handler, and so its upstream request
        self._server = HttpServer(
            {
                CHAT_PATH: {"POST": self._chat_completions},
                COMPLETIONS_PATH: {"POST": self._completions},
                "/v1/models": {"GET": self._list_models},
                "/healthz": {"GET": self._healthz},
                "/health": {"GET": self._health},
                "/version": {"GET": self._version},
                "/metrics": {"GET": self._metrics},
            },
            self._on_error,
            headers=[("X-Gateway", self.settings.name)],
            max_body_bytes=MAX_BODY_BYTES,
        )
        try:
            self.port = await self._server.start(self.settings.host, self.settings.port)
        except OSError as exc:
            await self.stop()
            raise StackError(
                f"gateway {self.settings.name}: cannot listen on "
                f"{self.settings.host}:{self.settings.port}: {exc}"
            ) from exc

    async def stop(self) -> None:
        """Stop listening and release every connection, pool and thread."""
        for task in (self._health_task, self._degradation_task, self._discovery_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed(_SHUTDOWN_TIMEOUT_S)
        if self._session is not None:
            await self._session.close()
        if self._upstream is not None:
            self._upstream.close()
        self._auth.close()
        self._db.close()

    async def _chat_completions(self, request: Request, responder: Responder) -> Response | None:
        return await self._generate(request, responder, CHAT_PATH)

    async def _completions(self, request: Request, responder: Responder) -> Response | None:
        return await self._generate(request, responder, COMPLETIONS_PATH)

    async def _generate(self, request: Request, responder: Responder, path: str) -> Response | None:
        started_s = time.perf_counter()
        mode = "none"
        status = 500
        try:
            tenant = await self._authenticate(request)
            generation = parse_generation_request(request.body, self._models, path == CHAT_PATH)
            self._admit()
            body, degraded = self.degradation.admit(generation, request.body)
            if degraded:  # every answer to it says so, an error too
                request.answer_headers = DEGRADED_HEADERS
            assert self._proxy is not None
            status, response, mode = await self._proxy.forward(
                request,
                responder,
                path,
                body,
                generation.stream,
                tenant,
                sum(generation.prompt_tokens),
                self.degradation.output_tokens(degraded, generation),
            )
            return response
        except ApiError as exc:
            status = exc.status
            return error_answer(exc)
        except asyncio.CancelledError:
            status = _CLIENT_CLOSED_STATUS
            self.metrics.client_disconnects.inc()
            raise
        finally:
            self.metrics.observe_request(mode, status, time.perf_counter() - started_s)

    async def _authenticate(self, request: Request) -> str:
        """The tenant of the request's bearer token.

        Raises ApiError 401 `invalid_api_key`, or 503 when the token table cannot be read.
        """
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
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

    async def _list_models(self, request: Request, _: Responder) -> Response:
        await self._authenticate(request)
        return json_answer(self._models_body)

    async def _health(self, request: Request, _: Responder) -> Response:
        return Response(content_type="text/plain")

    async def _version(self, request: Request, _: Responder) -> Response:
        return json_answer({"version": VERSION})

    async def _healthz(self, request: Request, _: Responder) -> Response:
        return json_answer(
            {
                "status": "ok",
                "name": self.settings.name,
                "healthy_workers": self.pool.healthy_counts(),
                "estimated_queue": self.pool.estimated_queue(),
            }
        )

    async def _metrics(self, request: Request, _: Responder) -> Response:
        return Response(body=self.metrics.render(), content_type=CONTENT_TYPE)

    def _on_error(self, exc: BaseException, request: Request | None) -> Response:
        return error_answer(api_error_for(exc, request, _INTERNAL_ERROR, log))
