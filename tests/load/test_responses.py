"""Outcome classes and SSE parsing (TTFT, tokens/s, missing [DONE] = bad body)."""

from __future__ import annotations

import time

import pytest

from llmchaos.load.responses import classify, read_stream

OK = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}'


@pytest.mark.parametrize(
    ("status", "body", "outcome"),
    [
        (200, OK, "ok"),
        (200, b"", "bad_body"),
        (200, b'{"choices": []}', "bad_body"),
        (200, b"<html>", "bad_body"),
        (429, b"{}", "429"),
        (503, b"", "5xx"),
        (401, b"{}", "4xx"),
        (302, b"", "bad_body"),
    ],
)
def test_classify(status: int, body: bytes, outcome: str):
    assert classify(status, body) == outcome


class Lines:
    def __init__(self, *lines: bytes, gap_s: float = 0.0):
        self.lines = list(lines)
        self.gap_s = gap_s

    def readline(self, sep: bytes = b"\n") -> bytes:
        if self.gap_s:
            time.sleep(self.gap_s)
        return self.lines.pop(0) if self.lines else b""


def test_stream_ttft_and_tokens_per_s():
    role = b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n'
    tok = b'data: {"choices": [{"delta": {"content": "x "}}]}\n'
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n'
    due = time.monotonic()
    outcome, ttft_ms, rate = read_stream(
        Lines(role, b"\n", tok, b"\n", tok, tok, tok, usage, b"data: [DONE]\n", gap_s=0.01), due
    )
    assert outcome == "ok"
    assert 15 <= ttft_ms <= 200
    assert 40 <= rate <= 105  # 3 tokens after the first, 3 reads of >= 10 ms apart


def test_stream_without_done_is_a_bad_body():
    tok = b'data: {"choices": [{"delta": {"content": "x "}}]}\n'
    assert read_stream(Lines(tok, tok), time.monotonic())[0] == "bad_body"
    assert read_stream(Lines(b"data: not json\n"), time.monotonic())[0] == "bad_body"
