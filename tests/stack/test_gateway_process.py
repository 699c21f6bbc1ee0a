"""The gateway as a process: `python -m llmchaos.stack.gateway --settings PATH`."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from openai import APIConnectionError, AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from llmchaos.stack.settings import GatewaySettings, write_settings
from tests.stack import gateway_fixtures as fx
from tests.stack.gateway_fixtures import MODEL, FakeUpstream, RedisServer, gateway_settings

redis_server = fx.redis_server
token_db = fx.token_db
upstreams = fx.upstreams

Upstreams = Callable[..., Awaitable[FakeUpstream]]
Launch = Callable[[Path], subprocess.Popen[bytes]]


@pytest.fixture
def launch() -> Iterator[Launch]:
    """Start gateway processes; any still running at the end are killed."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(settings_path: Path) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "llmchaos.stack.gateway", "--settings", str(settings_path)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=5)


async def _wait_listening(url: str, proc: subprocess.Popen[bytes]) -> None:
    async with aiohttp.ClientSession() as session:

        async def up() -> bool:
            assert proc.poll() is None, proc.communicate()[1].decode()
            try:
                async with session.get(f"{url}/healthz", timeout=aiohttp.ClientTimeout(0.5)) as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        await fx.wait_for(up, 15.0, "the gateway process's /healthz")


async def _exit_after(proc: subprocess.Popen[bytes], signum: int) -> tuple[int, float]:
    proc.send_signal(signum)
    started = time.monotonic()
    while proc.poll() is None and time.monotonic() - started < 5.0:
        await asyncio.sleep(0.01)
    assert proc.poll() is not None, "the gateway did not exit within 5 s"
    return proc.returncode, time.monotonic() - started


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.asyncio
async def test_process_serves_then_exits_promptly_on_signal(
    redis_server: RedisServer,
    token_db: Path,
    upstreams: Upstreams,
    launch: Launch,
    tmp_path: Path,
    signum: int,
) -> None:
    fake = await upstreams("gpu-0")
    settings = replace(
        gateway_settings(redis_server, token_db, [fake.upstream()]), port=fx.free_port()
    )
    proc = launch(write_settings(settings, tmp_path / "gateway.json"))
    url = f"http://127.0.0.1:{settings.port}"
    await _wait_listening(url, proc)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="tok-alice", max_retries=0, timeout=5)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    reply = await client.chat.completions.create(model=MODEL, messages=messages)
    stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
    words = [c.choices[0].delta.content async for c in stream if c.choices]
    assert reply.choices[0].message.content == "served by gpu-0"
    assert "".join(w or "" for w in words) == "".join(fx.SSE_WORDS)
    # a request still in flight must not hold the exit up
    fake.hold = asyncio.Event()
    pending = asyncio.ensure_future(client.chat.completions.create(model=MODEL, messages=messages))
    await fx.wait_for(_fake_busy(fake), 3.0, "the held request to reach the fake worker")
    returncode, exit_s = await _exit_after(proc, signum)
    with pytest.raises(APIConnectionError):  # the connection just goes away
        await pending
    await client.close()
    stderr = proc.communicate()[1].decode()
    assert returncode == 0, stderr
    assert exit_s < 1.2, stderr
    assert "Traceback" not in stderr, stderr


def _fake_busy(fake: FakeUpstream) -> Callable[[], Awaitable[bool]]:
    async def busy() -> bool:
        return fake.in_flight == 1

    return busy


def test_invalid_settings_exit_2_naming_the_field(launch: Launch, tmp_path: Path) -> None:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps({"name": "g", "queue_shed_treshold": 5}))
    proc = launch(path)
    _, stderr = proc.communicate(timeout=15)
    assert proc.returncode == 2
    assert "queue_shed_treshold" in stderr.decode()
    assert "Traceback" not in stderr.decode()


def test_missing_token_table_exits_1_naming_the_path(launch: Launch, tmp_path: Path) -> None:
    settings = GatewaySettings(port=fx.free_port(), token_db_path=str(tmp_path / "none.sqlite"))
    proc = launch(write_settings(settings, tmp_path / "gateway.json"))
    _, stderr = proc.communicate(timeout=15)
    assert proc.returncode == 1
    assert "none.sqlite" in stderr.decode()
    assert "Traceback" not in stderr.decode()
