"""Reading answers: outcome classes of plain answers, SSE streams (TTFT, tokens/s).

No gevent import: testable alone.
"""

from __future__ import annotations

import json

from llmchaos.load.http1 import BadResponse

__all__ = ["SseReader", "classify"]

_MAX_LINE_BYTES = 1 << 20
"""An SSE line longer than this is refused (a stream without newlines would grow forever)."""


def classify(status: int, body: bytes) -> str:
    """The outcome of a non-streaming answer: "ok" or its failure class."""
    if status >= 500:
        return "5xx"
    if status == 429:
        return "429"
    if 400 <= status < 500:
        return "4xx"
    if status != 200:
        return "bad_body"
    try:
        message = json.loads(body)["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return "bad_body"
    return "ok" if isinstance(message.get("content"), str) else "bad_body"


class SseReader:
    """An SSE body read as it arrives: `data: {json}` lines up to `data: [DONE]`.

    Fed by the HTTP parser in the gevent loop's callbacks (http1.BodySink): chunk times are
    the times the bytes were received. A data line that is not JSON raises BadResponse, so the
    request ends as a bad body at once instead of waiting for the rest of the stream.
    """

    __slots__ = ("_tail", "chunks", "done", "first", "last", "usage_tokens")

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.chunks = 0
        self.usage_tokens: object = None
        self.done = False
        self._tail = b""

    def feed(self, data: bytes, now: float) -> None:
        if self._tail:
            data = self._tail + data
        lines = data.split(b"\n")
        self._tail = lines.pop()  # an unfinished line waits for its end
        if len(self._tail) > _MAX_LINE_BYTES:
            raise BadResponse("SSE line too long")
        for line in lines:
            if line.startswith(b"data:"):
                self._data(line[5:].strip(), now)

    def _data(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        if b'"usage"' in payload or self.first is None:
            try:
                chunk = json.loads(payload)
            except ValueError:
                raise BadResponse("SSE data line is not JSON") from None
            usage = chunk.get("usage") if isinstance(chunk, dict) else None
            if usage:
                self.usage_tokens = usage.get("completion_tokens")
        if b'"content"' in payload:
            self.chunks += 1
            if self.first is None:
                self.first = now
            self.last = now

    def result(self, due: float) -> tuple[str, float | None, float | None]:
        """(outcome, TTFT ms from `due`, tokens/s) once the stream ended."""
        first, last = self.first, self.last
        if not self.done or first is None or last is None:
            return "bad_body", None, None
        usage = self.usage_tokens
        tokens = usage if isinstance(usage, int) and usage > 0 else self.chunks
        rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
        return "ok", (first - due) * 1000.0, rate
