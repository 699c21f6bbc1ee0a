"""The raw-socket client of the open-loop user against a scripted server: outcome classes,
keep-alive reuse, and connections that are closed, never reused, after a timeout or a broken
answer.

Runs the gevent loop in this process (without monkey-patching anything); the server is plain
blocking sockets in threads.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import gevent
import pytest

from llmchaos.load.client import SWEEP_S, Client, Exchange
from llmchaos.load.responses import Answer

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}"
BODY = b'{"choices": [{"message": {"content": "ok"}}]}'
OK = b"HTTP/1.1 200 OK\r\nX-Serving-Mode: gpu\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
CLOSE, HANG = "close", "hang"
Script = bytes | list[bytes]
Outcome = tuple[str, str | None, float | None, float | None, float]


class ScriptedServer:
    """Answers each request with the next script step: bytes to send (a list: sent apart, 20 ms
    between them), then maybe CLOSE (the connection) or HANG (until the client closes it).
    Counts connections and their ends."""

    def __init__(self, steps: list[tuple[Script, str | None]]) -> None:
        self.steps = steps
        self.lock = threading.Lock()
        self.accepted = 0
        self.client_closed = threading.Event()
        self.request_sizes: list[int] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf or len(buf) < self._request_size(buf):
                    data = conn.recv(1 << 20)
                    if not data:
                        self.client_closed.set()
                        return
                    buf += data
                size = self._request_size(buf)
                with self.lock:
                    self.request_sizes.append(size)
                buf = buf[size:]
                with self.lock:
                    answer, then = self.steps.pop(0)
                for i, piece in enumerate([answer] if isinstance(answer, bytes) else answer):
                    if i:
                        time.sleep(0.02)
                    conn.sendall(piece)
                if then == CLOSE:
                    return
                if then == HANG:
                    while conn.recv(65536):
                        pass
                    self.client_closed.set()
                    return

    @staticmethod
    def _request_size(buf: bytes) -> int:
        head, _, _ = buf.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        return len(head) + 4 + length

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def server() -> Iterator[Callable[[list[tuple[Script, str | None]]], ScriptedServer]]:
    started: list[ScriptedServer] = []

    def start(steps: list[tuple[Script, str | None]]) -> ScriptedServer:
        s = ScriptedServer(steps)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


class Results:
    def __init__(self) -> None:
        self.done: list[Outcome] = []

    def __call__(self, ex: Exchange, answer: Answer, mode: str | None, now: float) -> None:
        self.done.append((answer.outcome, mode, answer.ttft_ms, answer.tpot_ms, now - ex.due))


def exchange(
    client: Client, results: Results, stream: bool = False, request: bytes = REQUEST
) -> Outcome:
    """One request, run until its outcome is reported (5 s at most)."""
    n = len(results.done)
    client.request(request, Exchange(0, time.monotonic(), "t", stream))
    deadline = time.monotonic() + 5.0
    while len(results.done) == n and time.monotonic() < deadline:
        gevent.sleep(0.001)
    assert len(results.done) == n + 1, "no outcome reported"
    return results.done[-1]


def make_client(port: int, timeout_s: float = 5.0) -> tuple[Client, Results]:
    results = Results()
    return Client("127.0.0.1", port, timeout_s, results), results


def test_keep_alive_answers_reuse_one_connection(server):
    s = server([(OK, None), ([OK[:20], OK[20:40], OK[40:]], None), (OK, None)])
    client, results = make_client(s.port)
    try:
        assert exchange(client, results)[:2] == ("ok", "gpu")
        assert exchange(client, results)[:2] == ("ok", "gpu")  # its answer came in 3 sends
        assert exchange(client, results)[:2] == ("ok", "gpu")
        assert s.accepted == 1
    finally:
        client.close()


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        (b"", "connection"),  # closed before any byte
        (OK[:-5], "bad_body"),  # truncated body
        (OK[:30], "bad_body"),  # closed in the headers
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "bad_body"),
        (b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", "5xx"),
        (b"HTTP/1.1 200 OK\r\n\r\n" + BODY, "ok"),  # a body that ends with the connection
    ],
)
def test_an_answer_ended_by_the_close_is_classed_and_the_next_request_reconnects(
    server, answer: bytes, outcome: str
):
    s = server([(answer, CLOSE), (OK, None)])
    client, results = make_client(s.port)
    try:
        assert exchange(client, results)[0] == outcome
        assert exchange(client, results)[:2] == ("ok", "gpu")
        assert s.accepted == 2
    finally:
        client.close()


def test_bytes_after_an_answer_make_its_connection_unusable(server):
    s = server([(OK + b"junk", None), (OK, None)])
    client, results = make_client(s.port)
    try:
        assert exchange(client, results)[0] == "ok"
        assert exchange(client, results)[0] == "ok"
        assert s.accepted == 2
    finally:
        client.close()


def test_timeout_closes_the_connection_and_never_reuses_it(server):
    s = server([(OK[:30], HANG), (OK, None)])
    client, results = make_client(s.port, timeout_s=0.3)
    try:
        outcome, mode, _, _, elapsed_s = exchange(client, results)
        assert outcome == "timeout" and mode is None
        assert 0.3 <= elapsed_s < 0.3 + SWEEP_S + 0.2
        assert s.client_closed.wait(2.0)  # the client closed it
        assert exchange(client, results)[0] == "ok"
        assert s.accepted == 2
    finally:
        client.close()


def test_chunked_sse_stream_gives_ttft_and_tpot(server):
    tok = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
    events = [tok, tok, b'data: {"usage": {"completion_tokens": 3}}\n\n', b"data: [DONE]\n\n"]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nX-Serving-Mode: cpu\r\nTransfer-Encoding: chunked\r\n\r\n"
    s = server([(head + chunks, None)])
    client, results = make_client(s.port)
    try:
        outcome, mode, ttft_ms, tpot_ms, elapsed_s = exchange(client, results, stream=True)
        assert (outcome, mode) == ("ok", "cpu")
        assert ttft_ms is not None and 0 < ttft_ms <= elapsed_s * 1000.0
        assert tpot_ms is not None and 0 <= tpot_ms <= elapsed_s * 1000.0
    finally:
        client.close()


def test_refused_connection_is_a_connection_failure():
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed again: nothing listens there
    client, results = make_client(port)
    try:
        assert exchange(client, results)[0] == "connection"
    finally:
        client.close()


def test_a_request_larger_than_the_socket_buffer_is_sent_whole(server):
    body = b"x" * (8 << 20)  # the first send() takes part of it; the write watcher the rest
    big = b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    s = server([(OK, None), (OK, None)])
    client, results = make_client(s.port)
    try:
        assert exchange(client, results, request=big)[0] == "ok"
        assert exchange(client, results)[0] == "ok"
        assert s.request_sizes == [len(big), len(REQUEST)] and s.accepted == 1
    finally:
        client.close()
