"""Requests shaped like LLM traffic: prompt lengths in range with the declared tail, bodies."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from llmchaos.errors import InvalidInput
from llmchaos.load.traffic import Tenant, TrafficModel, TrafficSpec, load_tenants
from llmchaos.stack.tokens import count_tokens

N = 60_000


def tail(x: float, m: float = 10, big: float = 4096, a: float = 1.2) -> float:
    """P(L >= x) of the truncated Pareto law the model declares."""
    return ((m / x) ** a - (m / big) ** a) / (1 - (m / big) ** a)


def test_prompt_lengths_in_range_with_declared_tail():
    model = TrafficModel(TrafficSpec(), seed=1)
    lengths = [model.prompt_tokens() for _ in range(N)]
    assert min(lengths) == 10
    assert max(lengths) <= 4096
    for x in (20, 100, 1000):
        p = tail(x)
        observed = sum(1 for n in lengths if n >= x) / N
        sigma = math.sqrt(p * (1 - p) / N)
        assert abs(observed - p) < 5 * sigma + 1e-4, (x, observed, p)
    # A real tail: prompts past 1000 tokens exist but stay rare (about 0.33%).
    assert 0.002 < sum(1 for n in lengths if n > 1000) / N < 0.005


def test_output_lengths_bounded_around_median():
    model = TrafficModel(TrafficSpec(), seed=2)
    outs = sorted(model.output_tokens() for _ in range(20_000))
    assert outs[0] >= 1
    assert outs[-1] <= 1024
    assert 58 <= outs[len(outs) // 2] <= 70


def test_request_body_is_an_openai_chat_request_with_the_chosen_tokens():
    tenants = [Tenant("t1", "alpha"), Tenant("t2", "beta"), Tenant("r1", "alpha", revoked=True)]
    model = TrafficModel(TrafficSpec(stream_share=0.5), tenants, seed=3)
    streams = 0
    for _ in range(500):
        req = model.next_request()
        body = json.loads(req.body)
        assert body["model"] == "llmchaos-7b"
        text = "\n".join(m["content"] for m in body["messages"])
        assert count_tokens(text) == req.prompt_tokens
        assert body["max_tokens"] == req.max_tokens
        assert body.get("stream", False) == req.stream
        streams += req.stream
        assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", req.headers["traceparent"])
        assert req.headers["Authorization"] in ("Bearer t1", "Bearer t2")
    assert 200 < streams < 300


def test_bad_token_share_sends_revoked_and_unknown_tokens():
    tenants = [Tenant("t1", "alpha"), Tenant("r1", "alpha", revoked=True)]
    model = TrafficModel(TrafficSpec(bad_token_share=0.4), tenants, seed=4)
    auths = [model.next_request().headers["Authorization"] for _ in range(5000)]
    bad = sum(1 for a in auths if a != "Bearer t1")
    assert 1800 < bad < 2200
    assert any(a == "Bearer r1" for a in auths)
    assert any(a.startswith("Bearer unknown-") for a in auths)


def test_tokens_file_errors_name_the_flag(tmp_path: Path):
    with pytest.raises(InvalidInput, match="--tokens: cannot read"):
        load_tenants(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"nope": 1}')
    with pytest.raises(InvalidInput, match=r"--tokens: .* is not a tokens file"):
        load_tenants(bad)
    good = tmp_path / "tokens.json"
    good.write_text('{"tokens": [{"token": "a", "tenant": "x", "revoked": false}]}')
    assert load_tenants(good) == [Tenant("a", "x", False)]
