"""Outcome classes and SSE timing (TTFT, ITL, TPOT as vLLM bench / GuideLLM define them)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmchaos.errors import InvalidInput
from llmchaos.load.goodput import GoodputSlo, parse_goodput
from llmchaos.load.http1 import BadResponse
from llmchaos.load.responses import Answer, SseReader, classify

OK = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}'
TOOL = (
    b'{"choices": [{"message": {"role": "assistant", "content": null, "tool_calls": '
    b'[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],'
    b' "usage": {"completion_tokens": 3}}'
)
TEXT = b'{"object": "text_completion", "choices": [{"index": 0, "text": " a b"}]}'


@pytest.mark.parametrize(
    ("status", "body", "outcome"),
    [
        (200, OK, "ok"),
        (200, TOOL, "ok"),  # content null with tool calls is an answer
        (200, TEXT, "ok"),  # /v1/completions
        (200, b"", "bad_body"),
        (200, b'{"choices": []}', "bad_body"),
        (200, b'{"choices": [{"message": {"content": null}}]}', "bad_body"),
        (200, b'{"choices": [5]}', "bad_body"),
        (200, b"<html>", "bad_body"),
        (429, b"{}", "429"),
        (503, b"", "5xx"),
        (401, b"{}", "4xx"),
        (302, b"", "bad_body"),
    ],
)
def test_classify(status: int, body: bytes, outcome: str):
    assert classify(status, body).outcome == outcome


def test_classify_reads_the_output_tokens_of_the_usage():
    assert classify(200, TOOL).output_tokens == 3
    assert classify(200, OK).output_tokens is None


def chunk(delta: dict[str, object], **extra: object) -> bytes:
    body = {"choices": [{"index": 0, "delta": delta}], **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


ROLE = chunk({"role": "assistant", "content": ""})  # vLLM's first chunk
EMPTY = chunk({"content": ""})
FINISH = chunk({}, usage=None)
TOK = chunk({"content": "x "})
USAGE = b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n\n'
DONE = b"data: [DONE]\n\n"


def read(*pieces: tuple[bytes, float], due: float = 0.0) -> Answer:
    reader = SseReader()
    try:
        for data, now in pieces:
            reader.feed(data, now)
    except BadResponse:
        return Answer("bad_body")
    return reader.result(due, pieces[-1][1])


def test_role_empty_and_finish_chunks_do_not_start_the_ttft_clock():
    answer = read(
        (ROLE, 0.001),
        (EMPTY, 0.002),
        (TOK, 0.100),
        (TOK, 0.110),
        (EMPTY, 0.115),
        (TOK, 0.130),
        (TOK + FINISH + USAGE + DONE, 0.160),
    )
    assert answer.outcome == "ok"
    assert answer.ttft_ms == pytest.approx(100.0)
    assert answer.itl_ms == pytest.approx([10.0, 20.0, 30.0])
    assert answer.output_tokens == 4
    assert answer.tpot_ms == pytest.approx((160.0 - 100.0) / 3)


def test_completions_chunks_count_by_their_text():
    text = b'data: {"choices": [{"index": 0, "text": " a", "finish_reason": null}]}\n\n'
    empty = b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n'
    answer = read((text, 0.05), (text, 0.07), (empty + DONE, 0.08))
    assert (answer.ttft_ms, answer.output_tokens) == (pytest.approx(50.0), 2)
    assert answer.tpot_ms == pytest.approx(30.0)


def test_compact_json_null_content_and_quoted_keys_inside_text():
    compact = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    null = b'data: {"choices":[{"delta":{"content":null}}]}\n\n'
    call = {"tool_calls": [{"function": {"arguments": json.dumps({"content": "x"})}}]}
    quoted = chunk(call)
    answer = read((compact, 0.01), (null, 0.02), (quoted, 0.03), (TOK + DONE, 0.04))
    assert answer.ttft_ms == pytest.approx(40.0) and answer.output_tokens == 1
    assert answer.tpot_ms is None  # one token: no time per output token


def test_stream_lines_split_across_reads_count_when_they_end():
    stream = ROLE + TOK + TOK + USAGE + DONE
    cut = len(ROLE) + 20  # inside the first token line
    answer = read((stream[:cut], 1.0), (stream[cut:-3], 2.0), (stream[-3:], 3.0))
    assert answer.outcome == "ok" and answer.ttft_ms == pytest.approx(2000.0)
    assert answer.itl_ms == [0.0]  # both tokens came in the same read


def test_tokens_without_usage_are_counted_chunks():
    answer = read((TOK, 1.0), (TOK, 1.5), (TOK + DONE, 2.0))
    assert answer.output_tokens == 3 and answer.tpot_ms == pytest.approx(500.0)


def test_stream_without_done_or_content_or_with_bad_json_is_a_bad_body():
    assert read((TOK, 1.0), (TOK, 2.0)).outcome == "bad_body"
    assert read((b"data: [DONE]\n", 1.0)).outcome == "bad_body"  # no token at all
    assert read((ROLE + EMPTY + DONE, 1.0)).outcome == "bad_body"  # role chunk only
    assert read((b"data: not json\n", 1.0)).outcome == "bad_body"
    assert read((TOK + b'data: {"usage": broken\n' + DONE, 1.0)).outcome == "bad_body"
    assert read((b"data: " + b"x" * (2 << 20), 1.0)).outcome == "bad_body"  # no end of line


@given(
    st.lists(
        st.one_of(
            st.text(max_size=8),
            st.none(),
            st.just('"content": "x"'),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_the_byte_scan_agrees_with_parsing_every_chunk(contents: list[str | None]):
    """Any content (quotes, escapes, keys inside strings): the reader counts a chunk exactly
    when a JSON parse finds a non-empty content string in it."""
    pieces = [(chunk({"content": c}), 0.01 * (i + 1)) for i, c in enumerate(contents)]
    expected = sum(1 for c in contents if isinstance(c, str) and c)
    answer = read(*pieces, (DONE, 1.0))
    if expected == 0:
        assert answer.outcome == "bad_body"
    else:
        assert answer.output_tokens == expected


def test_goodput_slo_is_vllm_s_definition():
    slo = parse_goodput(["ttft:100", "tpot:10", "e2el:1000"])
    assert slo == GoodputSlo(100.0, 10.0, 1000.0)
    assert slo.met(e2e_ms=500, ttft_ms=90, tpot_ms=9)
    assert not slo.met(e2e_ms=500, ttft_ms=110, tpot_ms=9)
    assert not slo.met(e2e_ms=500, ttft_ms=90, tpot_ms=11)
    assert not slo.met(e2e_ms=1001, ttft_ms=90, tpot_ms=9)
    assert not slo.met(e2e_ms=150, ttft_ms=None, tpot_ms=None)  # plain: TTFT is its e2e
    assert slo.met(e2e_ms=90, ttft_ms=None, tpot_ms=None)
    assert not GoodputSlo().defined
    for bad in (["ttft"], ["ttfb:100"], ["tpot:-1"], ["e2el:nan"], ["ttft:x"]):
        with pytest.raises(InvalidInput, match="--goodput"):
            parse_goodput(bad)
