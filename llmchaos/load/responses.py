"""Reading answers: outcome classes of plain answers, SSE streams timed as the field times them.

Definitions (vLLM `bench serve`, GuideLLM and AIPerf agree on them; the load README says more):

- TTFT: from the request's scheduled send time to the first chunk whose content is not empty
  (`choices[].delta.content` of a chat chunk, `choices[].text` of a /v1/completions chunk). The
  role chunk `{"role": "assistant", "content": ""}`, empty deltas, usage-only and finish chunks
  do not count: they carry no token.
- ITL: every gap between two successive content-bearing chunks of one stream.
- TPOT: (e2e - TTFT) / (output tokens - 1), output tokens from `usage.completion_tokens` when
  the server sends it, else the number of content-bearing chunks.

No gevent import: testable alone.
"""

from __future__ import annotations

import json
from typing import Any

from llmchaos.load.http1 import BadResponse

__all__ = ["Answer", "SseReader", "classify"]

_MAX_LINE_BYTES = 1 << 20
"""An SSE line longer than this is refused (a stream without newlines would grow forever)."""
_CONTENT_KEYS = (b'"content"', b'"text"')
_SPACE = b" \t\r\n"


class Answer:
    """What the load records about one answered request (times in ms)."""

    __slots__ = ("itl_ms", "outcome", "output_tokens", "tpot_ms", "ttft_ms")

    def __init__(
        self,
        outcome: str,
        *,
        ttft_ms: float | None = None,
        itl_ms: list[float] | None = None,
        tpot_ms: float | None = None,
        output_tokens: int | None = None,
    ) -> None:
        self.outcome = outcome
        """"ok" or a failure class."""
        self.ttft_ms = ttft_ms
        """From the scheduled send time; streams only."""
        self.itl_ms = itl_ms
        """Gaps between content-bearing chunks; streams only."""
        self.tpot_ms = tpot_ms
        """Streams with at least two output tokens only."""
        self.output_tokens = output_tokens
        """From usage, else counted content chunks; None when unknown."""


def _usage_tokens(data: Any) -> int | None:
    usage = data.get("usage") if isinstance(data, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


def classify(status: int, body: bytes) -> Answer:
    """The outcome of a non-streaming answer: "ok" or its failure class, with the output
    tokens of its usage. "ok" needs a 200 with a first choice that is a chat message (content
    text, or tool calls) or a completion (`text`)."""
    if status >= 500:
        return Answer("5xx")
    if status == 429:
        return Answer("429")
    if 400 <= status < 500:
        return Answer("4xx")
    if status != 200:
        return Answer("bad_body")
    try:
        data = json.loads(body)
        choice = data["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return Answer("bad_body")
    if not isinstance(choice, dict):
        return Answer("bad_body")
    message = choice.get("message")
    if isinstance(message, dict):
        ok = isinstance(message.get("content"), str) or bool(message.get("tool_calls"))
    else:
        ok = isinstance(choice.get("text"), str)
    return Answer("ok" if ok else "bad_body", output_tokens=_usage_tokens(data))


def _has_content(payload: bytes) -> bool:
    """True when a chunk has a non-empty "content" or "text" string, read from the bytes:
    parsing every chunk as JSON would cost more than the rest of the load per chunk. A key
    inside a string value is escaped (`\\"content\\"`) and skipped."""
    for key in _CONTENT_KEYS:
        start = 0
        while True:
            at = payload.find(key, start)
            if at < 0:
                break
            start = at + len(key)
            if at and payload[at - 1 : at] == b"\\":
                continue
            rest = payload[start:].lstrip(_SPACE)
            if not rest.startswith(b":"):
                continue
            value = rest[1:].lstrip(_SPACE)
            if value[:1] == b'"' and value[1:2] not in (b'"', b""):
                return True
    return False


class SseReader:
    """An SSE body read as it arrives: `data: {json}` lines up to `data: [DONE]`.

    Fed by the HTTP parser in the gevent loop's callbacks (http1.BodySink): chunk times are
    the times the bytes were received. A data line that is not JSON raises BadResponse, so the
    request ends as a bad body at once instead of waiting for the rest of the stream. The first
    data line and every line with a usage are parsed; the others are only scanned for content.
    """

    __slots__ = ("_parsed", "_tail", "chunks", "done", "first", "gaps", "last", "usage_tokens")

    def __init__(self) -> None:
        self.first: float | None = None
        """Receive time of the first content-bearing chunk."""
        self.last: float | None = None
        self.gaps: list[float] = []
        """Seconds between successive content-bearing chunks."""
        self.chunks = 0
        """Content-bearing chunks."""
        self.usage_tokens: int | None = None
        self.done = False
        self._parsed = False
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
        if not self._parsed or b'"usage"' in payload:
            self._parsed = True
            try:
                chunk = json.loads(payload)
            except ValueError:
                raise BadResponse("SSE data line is not JSON") from None
            tokens = _usage_tokens(chunk)
            if tokens is not None:
                self.usage_tokens = tokens
        if _has_content(payload):
            self.chunks += 1
            last = self.last
            if last is None:
                self.first = now
            else:
                self.gaps.append(now - last)
            self.last = now

    def result(self, due: float, end: float) -> Answer:
        """The answer once the stream ended at `end` (monotonic s; `due` is the scheduled
        send time). A stream without [DONE] or without any content is a bad body."""
        first = self.first
        if not self.done or first is None:
            return Answer("bad_body")
        tokens = self.usage_tokens if self.usage_tokens is not None else self.chunks
        # (e2e - TTFT) / (tokens - 1), both from `due`: the stream's end minus its first token
        tpot_ms = (end - first) * 1000.0 / (tokens - 1) if tokens > 1 else None
        return Answer(
            "ok",
            ttft_ms=(first - due) * 1000.0,
            itl_ms=[gap * 1000.0 for gap in self.gaps],
            tpot_ms=tpot_ms,
            output_tokens=tokens,
        )
