"""vLLM OpenAI-server parity of the engine worker and of the gateway in front of it: one test
per item (status, and the error body's `code`), each against both.

The worker is the real app in this process (its engine at GPU timings); the gateway is the
real gateway with a real redis-server and token table, routing to that worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from llmchaos.stack import worker as worker_module
from llmchaos.stack.openai_api import MAX_BODY_BYTES, VERSION
from llmchaos.stack.settings import GPU_PROFILE, UpstreamWorker, WorkerSettings
from llmchaos.stack.tokens import count_tokens, make_text
from tests.stack.gateway_fixtures import (
    MODEL,
    RedisServer,
    gateway_settings,
    redis_server,
    running_gateway,
    token_db,
)

__all__ = ["redis_server", "token_db"]  # fixtures, used by name

PROFILE = dataclasses.replace(
    GPU_PROFILE, load_s=0.0, max_model_len=1024, prefill_base_ms=60.0, decode_base_ms=8.0
)
"""GPU timings with a long prefill, so a role chunk sent before prefill would show."""


@dataclass
class Target:
    name: str
    url: str
    headers: dict[str, str]
    session: aiohttp.ClientSession

    async def post(self, path: str, body: Any, **headers: str) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(
            self.url + path, data=data, headers={**self.headers, **headers}
        ) as resp:
            raw = await resp.read()
            return resp.status, json.loads(raw) if raw.startswith(b"{") else raw

    async def events(self, path: str, body: dict[str, Any]) -> list[tuple[float, Any]]:
        """(arrival s since the request, parsed event) of an SSE answer, [DONE] as "[DONE]"."""
        started = time.monotonic()
        out: list[tuple[float, Any]] = []
        async with self.session.post(self.url + path, json=body, headers=self.headers) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if line.startswith(b"data: "):
                    data = line[6:].strip()
                    event = "[DONE]" if data == b"[DONE]" else json.loads(data)
                    out.append((time.monotonic() - started, event))
        return out


@pytest_asyncio.fixture(params=["worker", "gateway"])
async def target(
    request: pytest.FixtureRequest, redis_server: RedisServer, token_db: Path
) -> AsyncIterator[Target]:
    settings = WorkerSettings(name="gpu-p", node="node-p", port=0, profile=PROFILE)
    worker = worker_module.WorkerServer(settings)
    worker_url = f"http://127.0.0.1:{await worker.start()}"
    try:
        async with aiohttp.ClientSession() as session:
            if request.param == "worker":
                yield Target("worker", worker_url, {}, session)
                return
            upstream = UpstreamWorker(name="gpu-p", url=worker_url, mode="gpu", node="node-p")
            async with running_gateway(gateway_settings(redis_server, token_db, [upstream])) as gw:
                for _ in range(100):
                    if (await gw.healthy()).get("gpu"):
                        break
                    await asyncio.sleep(0.05)
                auth = {"Authorization": "Bearer tok-alice"}
                yield Target("gateway", gw.base_url, auth, session)
    finally:
        await worker.stop()


def chat(max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": make_text(6)}],
        "max_tokens": max_tokens,
        **extra,
    }


def error_code(answer: Any) -> str | None:
    assert isinstance(answer, dict) and set(answer["error"]) == {"message", "type", "param", "code"}
    return answer["error"]["code"]


@pytest.mark.asyncio
async def test_health_is_vllm_s_and_healthz_stays(target: Target) -> None:
    async with target.session.get(target.url + "/health") as resp:
        assert (resp.status, await resp.read()) == (200, b"")
    async with target.session.get(target.url + "/healthz") as resp:
        assert resp.status == 200 and (await resp.json())["status"] in ("ok", "ready")


@pytest.mark.asyncio
async def test_version(target: Target) -> None:
    async with target.session.get(target.url + "/version") as resp:
        assert resp.status == 200 and await resp.json() == {"version": VERSION}


@pytest.mark.asyncio
async def test_completions_plain_and_streamed(target: Target) -> None:
    body = {"model": MODEL, "prompt": make_text(5), "max_tokens": 6}
    status, answer = await target.post("/v1/completions", body)
    assert status == 200 and answer["object"] == "text_completion"
    choice = answer["choices"][0]
    assert count_tokens(choice["text"]) == 6 and choice["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}

    events = await target.events("/v1/completions", {**body, "stream": True})
    assert events[-1][1] == "[DONE]"
    chunks = [e for _, e in events[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    default = {"model": MODEL, "prompt": "one two"}  # vLLM's default max_tokens: 16
    assert (await target.post("/v1/completions", default))[1]["usage"]["completion_tokens"] == 16


@pytest.mark.asyncio
async def test_n_choices_plain_and_streamed(target: Target) -> None:
    status, answer = await target.post("/v1/chat/completions", chat(3, n=3))
    assert status == 200
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert answer["usage"]["completion_tokens"] == 9
    events = await target.events("/v1/chat/completions", chat(3, n=2, stream=True))
    finished = {
        e["choices"][0]["index"] for _, e in events[:-1] if e["choices"][0]["finish_reason"]
    }
    assert finished == {0, 1}
    status, answer = await target.post("/v1/chat/completions", chat(3, n=2, temperature=0))
    assert (status, error_code(answer)) == (400, "invalid_value")  # vLLM: greedy needs n = 1
    status, answer = await target.post("/v1/chat/completions", chat(3, n=0))
    assert (status, error_code(answer)) == (400, "invalid_value")


@pytest.mark.asyncio
async def test_assistant_content_null_with_tool_calls_and_a_tool_call_answer(
    target: Target,
) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"],
                },
            },
        }
    ]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    status, answer = await target.post(
        "/v1/chat/completions", chat(32, tools=tools, tool_choice=forced)
    )
    assert status == 200, answer
    call = answer["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    status, answer = await target.post(
        "/v1/chat/completions", {"model": MODEL, "messages": history, "tools": tools}
    )
    assert status == 200 and answer["choices"][0]["message"]["content"]
    bad = [*history[:1], {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]
    status, answer = await target.post("/v1/chat/completions", {"model": MODEL, "messages": bad})
    assert (status, error_code(answer)) == (400, "invalid_type")
    unknown = {"type": "function", "function": {"name": "nope"}}
    status, answer = await target.post(
        "/v1/chat/completions", chat(tools=tools, tool_choice=unknown)
    )
    assert (status, error_code(answer)) == (400, "invalid_value")


@pytest.mark.asyncio
async def test_stop_sequences_and_finish_reason(target: Target) -> None:
    text = make_text(12)  # what the simulated model says: "the model serves tokens under ..."
    status, answer = await target.post("/v1/chat/completions", chat(12, stop=["tokens under"]))
    choice = answer["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.index("tokens under")]
    assert choice["stop_reason"] == "tokens under"
    assert answer["usage"]["completion_tokens"] == 5  # up to the token completing the match
    status, answer = await target.post("/v1/chat/completions", chat(12, stop="no such words"))
    assert answer["choices"][0]["finish_reason"] == "length"
    events = await target.events("/v1/chat/completions", chat(12, stop="serves", stream=True))
    chunks = [e for _, e in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == "the model " and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    status, answer = await target.post("/v1/chat/completions", chat(stop=[""]))
    assert (status, error_code(answer)) == (400, "invalid_value")


@pytest.mark.asyncio
async def test_role_chunk_comes_with_the_first_token_and_usage_only_when_asked(
    target: Target,
) -> None:
    events = await target.events("/v1/chat/completions", chat(5, stream=True))
    (role_at, role), (first_at, first) = events[0], events[1]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["delta"]["content"]
    assert first_at - role_at < 0.03 < role_at  # after the 60 ms prefill, with the token
    assert not any("usage" in e for _, e in events[:-1])

    usage = await target.events(
        "/v1/chat/completions", chat(5, stream=True, stream_options={"include_usage": True})
    )
    *_, (_, last), (_, done) = usage
    assert done == "[DONE]" and last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert sum("usage" in e for _, e in usage[:-1]) == 1

    continuous = await target.events(
        "/v1/chat/completions",
        chat(
            5, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
        ),
    )
    per_chunk = [e["usage"]["completion_tokens"] for _, e in continuous[:-2]]
    assert per_chunk[0] == 0 and per_chunk[-1] == 5 and per_chunk == sorted(per_chunk)


@pytest.mark.asyncio
async def test_stream_options_without_stream_is_a_400(target: Target) -> None:
    body = chat(stream_options={"include_usage": True})
    status, answer = await target.post("/v1/chat/completions", body)
    assert (status, error_code(answer), answer["error"]["param"]) == (
        400,
        "invalid_value",
        "stream_options",
    )
    status, answer = await target.post("/v1/completions", {"prompt": "a", **body})
    assert (status, error_code(answer)) == (400, "invalid_value")


@pytest.mark.asyncio
async def test_a_body_over_the_limit_is_a_413_with_a_code(target: Target) -> None:
    big = chat(messages=[{"role": "user", "content": "x " * (MAX_BODY_BYTES // 2 + 10)}])
    status, answer = await target.post("/v1/chat/completions", big)
    assert (status, error_code(answer)) == (413, "request_too_large")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "code"),
    [
        (chat(temperature="hot"), "invalid_type"),
        (chat(temperature=2.5), "invalid_value"),
        (chat(top_p=0), "invalid_value"),
        (chat(top_k=-2), "invalid_value"),
        (chat(presence_penalty=3), "invalid_value"),
        (chat(max_tokens=1.5), "invalid_type"),
        (chat(n=True), "invalid_type"),
        (chat(stop=[1]), "invalid_type"),
        (chat(seed=2**64), "invalid_value"),
        (chat(logprobs=True), "unsupported_parameter"),
        (chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
         "invalid_type"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
         "unsupported_parameter"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
        (b'{"model": "\xff\xfe"}', "invalid_json"),
        ({"prompt": "x"}, "missing_required_parameter"),
    ],
    ids=[
        "temperature-hot", "temperature-2.5", "top_p-0", "top_k", "presence", "max_tokens-float",
        "n-bool", "stop-int", "seed-huge", "logprobs", "text-part-5", "image-part", "nested",
        "not-utf8", "no-messages",
    ],
)  # fmt: skip
async def test_parameters_are_checked_as_vllm_checks_them(
    target: Target, body: Any, code: str
) -> None:
    status, answer = await target.post("/v1/chat/completions", body)
    assert (status, error_code(answer)) == (400, code)
