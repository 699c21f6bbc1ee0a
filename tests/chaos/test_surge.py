"""The long-prompt surge (llmchaos.surge) against a local HTTP server that records what it
gets: the rate, the body (prompt length, max_tokens, stream) and the counts by outcome."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from llmchaos import faults
from llmchaos.errors import InvalidInput
from llmchaos.surge import LongPromptSurge


class _Recorder(BaseHTTPRequestHandler):
    bodies: ClassVar[list[dict[str, Any]]] = []
    status: ClassVar[int] = 200
    hang: ClassVar[threading.Event | None] = None

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        type(self).bodies.append(json.loads(self.rfile.read(length)))
        if type(self).hang is not None:
            type(self).hang.wait(30)  # a stuck engine: no answer until the test lets go
        self.send_response(type(self).status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Handler", (_Recorder,), {"bodies": [], "status": 200})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.mark.parametrize("stream", [False, True])
def test_the_surge_sends_its_rate_of_long_prompts(
    server: tuple[str, type[_Recorder]], stream: bool
) -> None:
    url, handler = server
    surge = LongPromptSurge(
        url, "sk-x", "m", qps=20, duration_s=0.5, prompt_tokens=300, max_tokens=7, stream=stream
    )
    started = time.time()
    surge.start()
    assert surge.acting_until() >= started  # sending: it acts now
    time.sleep(0.8)
    counts = surge.stop()
    assert counts == {"ok": 10, "unfinished": 0}
    # done: it acted until its last answer, which came after its last send (at 0.45 s)
    assert started + 0.45 <= surge.acting_until() <= time.time()
    assert len(handler.bodies) == 10
    body = handler.bodies[0]
    assert body["stream"] is stream and body["max_tokens"] == 7
    assert len(body["messages"][0]["content"].split()) == 300


def test_the_surge_counts_what_failed(
    server: tuple[str, type[_Recorder]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, handler = server
    handler.status = 503
    # a clock that starts at 1000 s, where 1000 + 0.3 - 1000 < 0.3: CI once sent a 4th request
    real_monotonic = time.monotonic
    started = real_monotonic()
    monkeypatch.setattr(
        "llmchaos.surge.time",
        SimpleNamespace(time=time.time, monotonic=lambda: 1000.0 + real_monotonic() - started),
    )
    surge = LongPromptSurge(url, None, "m", qps=10, duration_s=0.3, prompt_tokens=1, max_tokens=1)
    surge.start()
    time.sleep(0.6)
    assert surge.stop() == {"5xx": 3, "unfinished": 0}


def test_stopping_a_surge_of_stuck_requests_counts_them_unfinished(
    server: tuple[str, type[_Recorder]],
) -> None:
    url, handler = server
    handler.hang = threading.Event()
    surge = LongPromptSurge(url, None, "m", qps=10, duration_s=0.3, prompt_tokens=1, max_tokens=1)
    surge.start()
    time.sleep(0.5)
    try:
        assert surge.stop(timeout_s=0.2) == {"unfinished": 3}
        assert surge.acting_until() >= time.time() - 1  # still out: it still acts
    finally:
        handler.hang.set()


def test_a_surge_rate_is_given_once() -> None:
    run: Any = SimpleNamespace()  # refused before the run is looked at
    with pytest.raises(InvalidInput, match=r"give qps .* or qps_per_gpu .*, not both"):
        faults.long_prompt_surge(run, qps=4, qps_per_gpu=0.5)
