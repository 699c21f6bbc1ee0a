"""Reading answers: outcome classes of plain answers, SSE streams (TTFT, tokens/s), headers.

No gevent import: the response object only needs `readline`, so this is testable alone.
"""

from __future__ import annotations

import json
import time
from typing import Protocol

__all__ = ["Headers", "classify", "read_stream"]


class _LineReader(Protocol):
    def readline(self, sep: bytes = ...) -> bytes: ...


class Headers(dict[str, str]):
    """Response headers, lower-cased in a plain dict: cheaper per header than the stock
    multi-valued Headers class, and only single values are read here."""

    def add(self, name: str, value: str) -> None:
        self[name.lower()] = value


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


def read_stream(response: _LineReader, due: float) -> tuple[str, float | None, float | None]:
    """Read SSE `data: {json}` lines up to `data: [DONE]`: (outcome, TTFT ms, tokens/s)."""
    first = last = None
    chunks = 0
    usage_tokens = None
    done = False
    while line := response.readline(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            continue
        now = time.monotonic()
        if b'"usage"' in payload or first is None:
            try:
                chunk = json.loads(payload)
            except ValueError:
                return "bad_body", None, None
            usage = chunk.get("usage") if isinstance(chunk, dict) else None
            if usage:
                usage_tokens = usage.get("completion_tokens")
        if b'"content"' in payload:
            chunks += 1
            first = first or now
            last = now
    if not done or first is None:
        return "bad_body", None, None
    tokens = usage_tokens if isinstance(usage_tokens, int) and usage_tokens > 0 else chunks
    rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
    return "ok", (first - due) * 1000.0, rate
