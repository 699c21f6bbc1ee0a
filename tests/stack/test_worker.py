"""The engine worker as a real process on 127.0.0.1, spoken to with the real `openai` client.

Every process started here is stopped by its fixture (terminate, then kill), also on failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmchaos.stack import worker as worker_module
from llmchaos.stack.settings import CPU_PROFILE, GPU_PROFILE, WorkerSettings, write_settings
from llmchaos.stack.tokens import count_tokens, make_text

MODEL = "llmchaos-7b"
READY_DEADLINE_S = 15.0
TEST_PROFILE = dataclasses.replace(
    GPU_PROFILE, load_s=0.3, max_num_seqs=4, max_model_len=512, kv_cache_tokens=4096
)
"""GPU timings, a small batch (a burst of 16 must queue) and a short context."""


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    settings: WorkerSettings

    def log(self) -> str:
        return self.log_path.read_text()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str) -> tuple[int, Any]:
    """Status and JSON body; raises OSError while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_listening(url: str) -> tuple[int, Any]:
    """The first answer of /healthz; fails the test after READY_DEADLINE_S."""
    deadline = time.monotonic() + READY_DEADLINE_S
    while time.monotonic() < deadline:
        try:
            return http_get(f"{url}/healthz")
        except OSError:
            time.sleep(0.02)
    pytest.fail(f"{url} did not listen within {READY_DEADLINE_S} s")


def wait_ready(url: str) -> dict[str, Any]:
    deadline = time.monotonic() + READY_DEADLINE_S
    while time.monotonic() < deadline:
        try:
            status, body = http_get(f"{url}/healthz")
            if status == 200:
                return dict(body)
        except OSError:
            pass
        time.sleep(0.02)
    pytest.fail(f"{url} not ready within {READY_DEADLINE_S} s")


def start_worker(settings: WorkerSettings, tmp: Path) -> WorkerProcess:
    settings = dataclasses.replace(settings, port=free_port())
    path = write_settings(settings, tmp / f"{settings.name}.json")
    log_path = tmp / f"{settings.name}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmchaos.stack.worker", "--settings", str(path)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    return WorkerProcess(proc, f"http://127.0.0.1:{settings.port}", log_path, settings)


def stop_worker(worker: WorkerProcess) -> None:
    if worker.proc.poll() is None:
        worker.proc.terminate()
        try:
            worker.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()


@pytest.fixture(scope="module")
def gpu_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    worker = start_worker(
        WorkerSettings(name="gpu-t", node="node-t", profile=TEST_PROFILE, gpu_index=1),
        tmp_path_factory.mktemp("worker"),
    )
    try:
        wait_ready(worker.url)
        yield worker
    finally:
        stop_worker(worker)
    assert "Traceback" not in worker.log()


@pytest.fixture
def fresh_worker(tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    """Workers a test starts itself (append to the list); all are stopped afterwards."""
    workers: list[WorkerProcess] = []
    try:
        yield workers
    finally:
        for worker in workers:
            stop_worker(worker)


def client(worker: WorkerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)


async def scrape(session: aiohttp.ClientSession, worker: WorkerProcess) -> dict[str, float]:
    """`name{label=value,...}` -> value, labels sorted, model_name left out."""
    async with session.get(f"{worker.url}/metrics") as resp:
        text = await resp.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name"
            )
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def chat_body(prompt_tokens: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": make_text(prompt_tokens)}],
        "max_tokens": max_tokens,
        **extra,
    }


@pytest.mark.slow
@pytest.mark.asyncio
async def test_plain_completion_through_the_openai_client(gpu_worker: WorkerProcess) -> None:
    async with client(gpu_worker) as api:
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": make_text(20)}],
            max_tokens=7,
        )
    completion = raw.parse()

    assert raw.headers["X-Serving-Mode"] == "gpu"
    assert raw.headers["X-Worker"] == "gpu-t"
    assert completion.object == "chat.completion"
    assert completion.choices[0].finish_reason == "length"
    assert count_tokens(completion.choices[0].message.content or "") == 7
    assert completion.usage is not None
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (20, 7, 27)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_streamed_completion_through_the_openai_client(gpu_worker: WorkerProcess) -> None:
    async with client(gpu_worker) as api:
        stream = await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": make_text(30)}],
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == make_text(9)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert finals[0].usage is None  # vLLM: usage only in its own chunk (or every chunk)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert not chunks[0].choices[0].delta.content  # the role chunk carries no token
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (30, 9)
    assert last.usage.total_tokens == 39
    assert len(chunks) >= 9  # token by token, not one lump


@pytest.mark.slow
@pytest.mark.asyncio
async def test_stream_without_include_usage_ends_with_done(gpu_worker: WorkerProcess) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{gpu_worker.url}/v1/chat/completions", json=chat_body(5, 3, stream=True)
        ) as resp,
    ):
        raw = (await resp.read()).decode()

    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in json.loads(e) for e in events[:-1])  # not asked for


@pytest.mark.slow
@pytest.mark.asyncio
async def test_context_length_exceeded_through_the_openai_client(
    gpu_worker: WorkerProcess,
) -> None:
    async with client(gpu_worker) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": make_text(500)}], max_tokens=13
            )

    assert caught.value.status_code == 400
    assert caught.value.code == "context_length_exceeded"
    assert (
        "This model's maximum context length is 512 tokens. However, you requested 513 tokens "
        "(500 in the messages, 13 in the completion)."
    ) in caught.value.message


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "body", "status", "code", "message"),
    [
        ("/v1/chat/completions", b"{not json", 400, "invalid_json", "not valid JSON"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "invalid_type",
         "'messages'"),
        ("/v1/chat/completions", {**chat_body(3, 3), "model": "gpt-x"}, 404, "model_not_found",
         "The model 'gpt-x' does not exist"),
        ("/v1/chat/completions", chat_body(3, 0), 400, "invalid_value", "'max_tokens'"),
        ("/v1/nothing", {}, 404, "not_found", "POST /v1/nothing: Not Found"),
    ],
    ids=["bad-json", "no-messages", "unknown-model", "zero-max-tokens", "unknown-path"],
)  # fmt: skip
async def test_bad_requests_get_openai_error_bodies(
    gpu_worker: WorkerProcess,
    path: str,
    body: bytes | dict[str, Any],
    status: int,
    code: str | None,
    message: str,
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{gpu_worker.url}{path}", data=data) as resp,
    ):
        answer = await resp.json()

    assert resp.status == status
    assert resp.headers["X-Worker"] == "gpu-t"
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["code"] == code
    assert message in answer["error"]["message"]
    assert "Traceback" not in json.dumps(answer)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_burst_over_max_num_seqs_shows_in_the_metrics(gpu_worker: WorkerProcess) -> None:
    n_requests = 16
    async with aiohttp.ClientSession() as session:
        before = await scrape(session, gpu_worker)

        async def one() -> int:
            url = f"{gpu_worker.url}/v1/chat/completions"
            async with session.post(url, json=chat_body(10, 20)) as resp:
                await resp.read()
                return resp.status

        burst = asyncio.gather(*(one() for _ in range(n_requests)))
        peak_waiting = peak_running = peak_kv = 0.0
        while not burst.done():
            now = await scrape(session, gpu_worker)
            peak_waiting = max(peak_waiting, now["vllm:num_requests_waiting{}"])
            peak_running = max(peak_running, now["vllm:num_requests_running{}"])
            peak_kv = max(peak_kv, now["vllm:kv_cache_usage_perc{}"])
            await asyncio.sleep(0.02)
        statuses = await burst
        after = await scrape(session, gpu_worker)

    assert statuses == [200] * n_requests
    assert peak_running == TEST_PROFILE.max_num_seqs
    assert peak_waiting >= n_requests - TEST_PROFILE.max_num_seqs - 2
    assert 0 < peak_kv <= 4 * 30 / TEST_PROFILE.kv_cache_tokens

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("vllm:request_success_total{finished_reason=length}") == n_requests
    assert grew("vllm:time_to_first_token_seconds_count{}") == n_requests
    assert grew("vllm:e2e_request_latency_seconds_count{}") == n_requests
    assert grew("vllm:prompt_tokens_total{}") == 10 * n_requests
    assert grew("vllm:generation_tokens_total{}") == 20 * n_requests
    # Queued requests waited: the slowest e2e is several batches' worth, above 0.5 s.
    assert grew("vllm:e2e_request_latency_seconds_bucket{le=0.5}") < n_requests
    assert after["vllm:num_requests_running{}"] == 0
    assert "vllm:num_preemptions_total{}" in after


@pytest.mark.slow
@pytest.mark.asyncio
async def test_errors_are_counted_by_code(gpu_worker: WorkerProcess) -> None:
    name = "llmchaos:worker_request_errors_total{code=context_length_exceeded}"
    async with aiohttp.ClientSession() as session:
        before = (await scrape(session, gpu_worker)).get(name, 0.0)
        url = f"{gpu_worker.url}/v1/chat/completions"
        async with session.post(url, json=chat_body(500, 100)) as resp:
            assert resp.status == 400
        after = (await scrape(session, gpu_worker))[name]

    assert after == before + 1


@pytest.mark.slow
@pytest.mark.asyncio
async def test_client_disconnect_mid_stream_aborts_the_sequence(gpu_worker: WorkerProcess) -> None:
    async with aiohttp.ClientSession() as session:
        before = await scrape(session, gpu_worker)
        url = f"{gpu_worker.url}/v1/chat/completions"
        # 400 tokens would stream for ~4.5 s; the client leaves after a few.
        resp = await session.post(url, json=chat_body(10, 400, stream=True))
        for _ in range(4):
            await resp.content.readuntil(b"\n\n")
        resp.close()
        deadline = time.monotonic() + 2.0
        while True:
            now = await scrape(session, gpu_worker)
            if now["vllm:num_requests_running{}"] == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)

    assert now["vllm:num_requests_running{}"] == 0
    assert now["vllm:kv_cache_usage_perc{}"] == 0
    aborted = "vllm:request_success_total{finished_reason=abort}"
    assert now[aborted] == before[aborted] + 1
    assert "Traceback" not in gpu_worker.log()


@pytest.mark.slow
def test_health_models_and_gpu_processes(gpu_worker: WorkerProcess) -> None:
    status, health = http_get(f"{gpu_worker.url}/healthz")
    assert status == 200
    assert health["status"] == "ready"
    assert (health["name"], health["node"], health["mode"]) == ("gpu-t", "node-t", "gpu")
    assert health["max_num_seqs"] == 4
    assert health["pid"] == gpu_worker.proc.pid

    status, models = http_get(f"{gpu_worker.url}/v1/models")
    assert status == 200
    assert [m["id"] for m in models["data"]] == [MODEL]

    status, processes = http_get(f"{gpu_worker.url}/gpu/processes")
    assert status == 200
    assert processes == [
        {
            "pid": gpu_worker.proc.pid,
            "process_name": sys.executable,
            "used_memory_mib": TEST_PROFILE.gpu_memory_mib,
            "gpu_index": 1,
        }
    ]


@pytest.mark.slow
def test_loading_answers_503_until_load_s_has_passed(
    fresh_worker: list[WorkerProcess], tmp_path: Path
) -> None:
    load_s = 1.5
    worker = start_worker(
        WorkerSettings(name="gpu-l", profile=dataclasses.replace(TEST_PROFILE, load_s=load_s)),
        tmp_path,
    )
    fresh_worker.append(worker)

    status, health = wait_listening(worker.url)
    listening_at = time.monotonic()
    assert (status, health["status"]) == (503, "loading")
    assert 0 < health["ready_in_s"] <= load_s
    request = urllib.request.Request(
        f"{worker.url}/v1/chat/completions", data=json.dumps(chat_body(3, 3)).encode()
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=2.0)
    assert caught.value.code == 503
    assert int(caught.value.headers["Retry-After"]) >= 1
    assert json.loads(caught.value.read())["error"]["code"] == "model_loading"

    wait_ready(worker.url)
    assert time.monotonic() - listening_at >= load_s - 0.3
    assert http_get(f"{worker.url}/v1/models")[0] == 200


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("signals", [1, 2], ids=["drain", "second-signal"])
async def test_cpu_worker_has_no_gpu_process_and_sigterm_drains_then_exits(
    fresh_worker: list[WorkerProcess], tmp_path: Path, signals: int
) -> None:
    worker = start_worker(
        WorkerSettings(name="cpu-t", profile=dataclasses.replace(CPU_PROFILE, load_s=0.2)),
        tmp_path,
    )
    fresh_worker.append(worker)
    await asyncio.to_thread(wait_ready, worker.url)

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{worker.url}/gpu/processes") as resp:
            assert await resp.json() == []
            assert resp.headers["X-Serving-Mode"] == "cpu"
        # A stream in flight (100 CPU tokens take ~11 s) holds the exit up for the drain only,
        # and a second signal not even that.
        stream = await session.post(
            f"{worker.url}/v1/chat/completions", json=chat_body(10, 100, stream=True)
        )
        await stream.content.readuntil(b"\n\n")
        sent_at = time.monotonic()
        for _ in range(signals):
            worker.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.1)
        returncode = await asyncio.to_thread(worker.proc.wait, 5.0)
        exit_s = time.monotonic() - sent_at
        stream.close()

    assert returncode == 0
    drain_s = worker.settings.shutdown_drain_s
    if signals == 1:
        assert drain_s <= exit_s < drain_s + 1.5
    else:
        assert exit_s < 1.0
    assert "Traceback" not in worker.log()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_sigterm_drains_health_first_then_the_port_and_lets_answers_finish(
    fresh_worker: list[WorkerProcess], tmp_path: Path
) -> None:
    worker = start_worker(WorkerSettings(name="gpu-d", profile=TEST_PROFILE), tmp_path)
    fresh_worker.append(worker)
    await asyncio.to_thread(wait_ready, worker.url)
    async with aiohttp.ClientSession() as session:
        # 60 tokens of 11 ms steps: about 0.7 s, inside the 1.5 s drain
        answer = asyncio.ensure_future(
            session.post(f"{worker.url}/v1/chat/completions", json=chat_body(3, 60))
        )
        await asyncio.sleep(0.2)
        sent_at = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        statuses: list[Any] = []
        late = None
        while time.monotonic() - sent_at < 3.0:
            try:
                status, body = await asyncio.to_thread(http_get, f"{worker.url}/healthz")
                statuses.append((status, body["status"]))
            except OSError:
                statuses.append("refused")
                break
            if late is None and body["status"] == "draining":
                # a request sent while the health checks say draining is still served
                late = await session.post(f"{worker.url}/v1/chat/completions", json=chat_body(3, 2))
            await asyncio.sleep(0.05)
        resp = await answer
        body = await resp.json()
        returncode = await asyncio.to_thread(worker.proc.wait, 5.0)
        exit_s = time.monotonic() - sent_at

    # draining (health 503) for about DEREGISTER_S, then the port closes
    assert (503, "draining") in statuses and statuses[-1] == "refused"
    assert (200, "ready") not in statuses[statuses.index((503, "draining")) :]
    assert late is not None and late.status == 200
    assert resp.status == 200 and body["usage"]["completion_tokens"] == 60
    assert returncode == 0
    assert worker_module.DEREGISTER_S <= exit_s < worker.settings.shutdown_drain_s + 1.0
    assert "Traceback" not in worker.log()


@pytest.mark.asyncio
async def test_unexpected_exception_is_a_500_openai_body(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object) -> list[object]:
        raise RuntimeError("boom in plan_choices")

    monkeypatch.setattr(worker_module, "plan_choices", broken)
    settings = WorkerSettings(port=0, profile=dataclasses.replace(TEST_PROFILE, load_s=0.0))
    server = worker_module.WorkerServer(settings)
    port = await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            async with http.post(url, json=chat_body(3, 2)) as resp:
                answer = await resp.json()
    finally:
        await server.stop()

    assert resp.status == 500
    assert answer["error"]["type"] == "internal_server_error"
    assert "boom" not in json.dumps(answer)
    assert "unexpected error in POST /v1/chat/completions" in caplog.text
