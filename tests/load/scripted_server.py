"""A reference OpenAI server with scripted timings, run as its own process: the arbiter of the
load's TTFT, ITL, TPOT and e2e.

    python -m tests.load.scripted_server --port-file F --ttft-ms T --itl-ms D --tokens N

POST /v1/chat/completions, from the moment the request has arrived:
- streamed: the headers and vLLM's role chunk `{"role": "assistant", "content": ""}` at once,
  then N content chunks of one token at T, T + D, ..., T + (N - 1) D ms, a finish chunk and a
  usage chunk (completion_tokens N) right after the last one, and [DONE];
- plain: the whole answer (with usage) at T + (N - 1) D ms.
So TTFT = T, every ITL = D, TPOT = D and e2e = T + (N - 1) D. GET /healthz answers 200
(HAProxy's check).

"From the moment the request arrived" is the kernel's receive time of its first bytes
(SO_TIMESTAMPNS, read with MSG_PEEK before the request is parsed), so a thread that wakes
late does not move it. (The threads may still write late on a busy machine: tests judge a
client against the wire, tests/load/wire_clock.py, not against this plan.)

A thread per connection sleeping to absolute deadlines (`time.sleep` has microsecond
resolution; an event loop's timers have milliseconds, which showed as +1 ms), unbuffered
writes with TCP_NODELAY, HTTP/1.1 keep-alive with chunked SSE bodies.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from llmchaos.load.stamps import ANCILLARY_BYTES, SO_TIMESTAMPNS, receive_time


def sse(body: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return sse({"object": "chat.completion.chunk", "choices": [choice]})


def _arrival(sock: socket.socket) -> float:
    """Kernel receive time (monotonic s) of the next bytes on `sock`, waiting for them."""
    _, ancillary, _, _ = sock.recvmsg(1, ANCILLARY_BYTES, socket.MSG_PEEK)
    return receive_time(ancillary) or time.monotonic()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    arrived = 0.0
    """Kernel receive time of the request being handled (monotonic s)."""
    script: tuple[float, float, int] = (0.0, 0.0, 1)
    """(TTFT ms, ITL ms, tokens), set by main()."""

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connection.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)

    def handle_one_request(self) -> None:
        try:
            self.arrived = _arrival(self.connection)
        except OSError:
            self.close_connection = True
            return
        super().handle_one_request()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._send(200, b'{"status": "ok"}', "application/json")

    def do_POST(self) -> None:
        start = self.arrived
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ttft_ms, itl_ms, tokens = self.script

        def until(offset_ms: float) -> None:
            time.sleep(max(0.0, start + offset_ms / 1000.0 - time.monotonic()))

        usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
        if not body.get("stream"):
            until(ttft_ms + (tokens - 1) * itl_ms)
            message = {"role": "assistant", "content": " ".join(["tok"] * tokens)}
            choice = {"index": 0, "message": message, "finish_reason": "length"}
            answer = {"object": "chat.completion", "choices": [choice], "usage": usage}
            self._send(200, json.dumps(answer).encode(), "application/json")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._chunk(chunk({"role": "assistant", "content": ""}))
        for k in range(tokens):
            until(ttft_ms + k * itl_ms)
            self._chunk(chunk({"content": "tok" if k == 0 else " tok"}))
        self._chunk(
            chunk({}, "length")
            + sse({"object": "chat.completion.chunk", "choices": [], "usage": usage})
            + b"data: [DONE]\n\n"
        )
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that closes its keep-alive connection at the end is no error


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--ttft-ms", type=float, required=True)
    parser.add_argument("--itl-ms", type=float, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--max-lifetime-s", type=float, default=120.0)
    args = parser.parse_args()
    Handler.script = (args.ttft_ms, args.itl_ms, args.tokens)
    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tmp = Path(args.port_file + ".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.rename(args.port_file)
    # Bounded: a test that forgets this server does not leave it running for long.
    time.sleep(args.max_lifetime_s)
    server.shutdown()


if __name__ == "__main__":
    main()
