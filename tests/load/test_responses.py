"""Outcome classes and SSE parsing (TTFT, tokens/s, missing [DONE] = bad body)."""

from __future__ import annotations

import pytest

from llmchaos.load.http1 import BadResponse
from llmchaos.load.responses import SseReader, classify

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


ROLE = b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n'
TOK = b'data: {"choices": [{"delta": {"content": "x "}}]}\n'
USAGE = b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n'
DONE = b"data: [DONE]\n"


def read(*pieces: tuple[bytes, float], due: float = 0.0) -> tuple[str, float | None, float | None]:
    reader = SseReader()
    try:
        for data, now in pieces:
            reader.feed(data, now)
    except BadResponse:
        return "bad_body", None, None
    return reader.result(due)


def test_stream_ttft_and_tokens_per_s():
    outcome, ttft_ms, rate = read(
        (ROLE + b"\n", 1.0),
        (TOK + b"\n", 1.01),
        (TOK, 1.02),
        (TOK, 1.03),
        (TOK + USAGE + DONE, 1.04),
    )
    assert outcome == "ok"
    assert ttft_ms == pytest.approx(1010.0)
    assert rate == pytest.approx(3 / 0.03)  # 4 tokens by usage: 3 after the first, in 30 ms


def test_stream_lines_split_across_reads_count_when_they_end():
    stream = ROLE + TOK + TOK + USAGE + DONE
    cut = len(ROLE) + 20  # inside the first token line
    outcome, ttft_ms, rate = read((stream[:cut], 1.0), (stream[cut:-3], 2.0), (stream[-3:], 3.0))
    assert outcome == "ok" and ttft_ms == pytest.approx(2000.0) and rate is None  # same read


def test_tokens_without_usage_are_counted_chunks():
    outcome, _, rate = read((TOK, 1.0), (TOK, 1.5), (TOK + DONE, 2.0))
    assert outcome == "ok" and rate == pytest.approx(2 / 1.0)


def test_stream_without_done_or_with_bad_json_is_a_bad_body():
    assert read((TOK, 1.0), (TOK, 2.0))[0] == "bad_body"
    assert read((b"data: [DONE]\n", 1.0))[0] == "bad_body"  # no token at all
    assert read((b"data: not json\n", 1.0))[0] == "bad_body"
    assert read((TOK + b'data: {"usage": broken\n' + DONE, 1.0))[0] == "bad_body"
    assert read((b"data: " + b"x" * (2 << 20), 1.0))[0] == "bad_body"  # no end of line
