"""Fuzzing the gateway's request parsing: whatever a client sends (bodies, header bytes, types,
encodings, nesting, broken HTTP), the answer is never a 5xx and every error is OpenAI-shaped
with a code. The gateway runs in a thread of its own (real redis-server, token table and a
fake upstream); requests go out as raw bytes, one connection each, so that anything can be
sent.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmchaos.stack.gateway import Gateway
from tests.stack.gateway_fixtures import (
    MODEL,
    FakeUpstream,
    RedisServer,
    free_port,
    gateway_settings,
    write_token_db,
)
from tests.stack.malformed_http import MALFORMED_REQUESTS

FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "stop", "stream",
    "stream_options", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "logprobs", "top_logprobs", "tools",
    "tool_choice", "response_format", "ignore_eos", "min_tokens", "user", "logit_bias",
    "best_of", "echo", "suffix", "prompt_logprobs",
]  # fmt: skip
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/nothing", "/health"]


class GatewayThread:
    """A gateway serving from an event loop in a thread; `stop()` ends both."""

    def __init__(self, redis: RedisServer, db: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.upstream = FakeUpstream("gpu-0")
        self._run(self.upstream.start())
        self.gateway = Gateway(gateway_settings(redis, db, [self.upstream.upstream()]))
        self._run(self.gateway.start())
        self.port = self.gateway.port

    def _run(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout=30)

    def stop(self) -> None:
        self._run(self.gateway.stop())
        self._run(self.upstream.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def module_redis() -> Iterator[RedisServer]:
    server = RedisServer(free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gateway(module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    db = write_token_db(tmp_path_factory.mktemp("tokens"))
    running = GatewayThread(module_redis, db)
    try:
        yield running.port
    finally:
        running.stop()


def send(port: int, raw: bytes) -> tuple[int, bytes]:
    """Send raw request bytes on a new connection; the status and body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read()


def request(path: str, body: bytes, headers: list[bytes]) -> bytes:
    head = [
        b"POST " + path.encode() + b" HTTP/1.1",
        b"Host: gateway",
        b"Connection: close",
        b"Content-Length: " + str(len(body)).encode(),
        *headers,
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def check(status: int, body: bytes) -> None:
    assert status < 500, (status, body[:300])
    if status >= 400:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["code"], str) and error["code"], error
        assert "Traceback" not in error["message"]


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
content_parts = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 5]), "text": json_values}),
    max_size=3,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "tool", ""]) | json_values,
            "content": st.text(max_size=20) | st.none() | content_parts | json_values,
        },
        optional={
            "tool_calls": json_values
            | st.just(
                [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
            ),
            "name": json_values,
        },
    ),
    max_size=3,
)
bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL) | json_values, "messages": messages},
    optional={name: json_values for name in FIELDS if name not in ("model", "messages")},
)


def encode(value: Any, how: str) -> bytes:
    text = json.dumps(value, allow_nan=True)
    if how == "utf-16":
        return text.encode("utf-16")
    if how == "latin-1-junk":
        return text.encode()[:-1] + b"\xff\xfe}"
    return text.encode()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(PATHS[:2]) | st.sampled_from(PATHS),
    body=bodies | json_values,
    how=st.sampled_from(["utf-8", "utf-8", "utf-8", "utf-16", "latin-1-junk"]),
    auth=st.sampled_from([b"Bearer tok-alice"] * 4 + [b"Bearer tok-revoked", b"Basic x"])
    | st.binary(max_size=24).map(lambda b: b"Bearer " + b),
    content_type=st.sampled_from([b"application/json", b"text/plain", b"\xff\xfe"]),
)
def test_any_request_is_answered_below_500_with_an_openai_error(
    gateway: int, path: str, body: Any, how: str, auth: bytes, content_type: bytes
) -> None:
    raw = request(
        path, encode(body, how), [b"Authorization: " + auth, b"Content-Type: " + content_type]
    )
    check(*send(gateway, raw))


@pytest.mark.parametrize("raw", MALFORMED_REQUESTS)
def test_malformed_http_gets_a_short_openai_error_and_no_traceback(
    gateway: int, raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    try:
        status, body = send(gateway, raw)
    except (http.client.BadStatusLine, ConnectionError):
        pytest.fail("the gateway closed the connection without an answer")
    check(status, body)
    assert status in (400, 404, 405, 413, 431, 501), status
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize(
    ("body", "auth", "status", "code"),
    [
        (b'{"model": "llmchaos-7b", "messages": [{"role": "user", "content": '
         b'[{"type": "text", "text": 5}]}]}', b"Bearer tok-alice", 400, "invalid_type"),
        (b'{"model": "llmchaos-7b", "messages": []}', b"Bearer tok-\xff\xfe\x80", 401,
         "invalid_api_key"),
        (b"[" * 100_000, b"Bearer tok-alice", 400, "invalid_json"),
        (b'{"model": "llmchaos-7b", "messages": [{"role": "user", "content": "x"}], '
         b'"temperature": "hot"}', b"Bearer tok-alice", 400, "invalid_type"),
    ],
    ids=["text-part-5", "non-utf8-authorization", "nested-100k", "temperature-hot"],
)  # fmt: skip
def test_issue_10_cases_are_client_errors(
    gateway: int, body: bytes, auth: bytes, status: int, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    raw = request("/v1/chat/completions", body, [b"Authorization: " + auth])
    answer_status, answer = send(gateway, raw)
    assert (answer_status, json.loads(answer)["error"]["code"]) == (status, code)
    assert "Traceback" not in caplog.text
