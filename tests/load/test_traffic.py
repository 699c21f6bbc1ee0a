"""Requests shaped like LLM traffic: prompt lengths in range with the declared tail, bodies."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from llmchaos.cli import main
from llmchaos.errors import InvalidInput
from llmchaos.load import LoadConfig, LoadRun
from llmchaos.load.api import check_config
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
    model = TrafficModel(TrafficSpec(output_median_tokens=64), seed=2)
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


TENANTS = [
    Tenant("t1", "alpha"),
    Tenant("r1", "stale", revoked=True),
    Tenant("r2", "stale", revoked=True),
]


def _bad_auths(kind: str, n: int = 5000) -> list[str]:
    model = TrafficModel(TrafficSpec(bad_token_share=0.4, bad_tokens=kind), TENANTS, seed=5)
    auths = [model.next_request().headers["Authorization"] for _ in range(n)]
    return [a for a in auths if a != "Bearer t1"]


def test_mixed_is_the_default_and_sends_both_kinds():
    assert TrafficSpec().bad_tokens == LoadConfig().traffic.bad_tokens == "mixed"
    bad = _bad_auths("mixed")
    revoked = sum(1 for a in bad if a in ("Bearer r1", "Bearer r2"))
    assert 1800 < len(bad) < 2200
    assert 0.4 < revoked / len(bad) < 0.6  # half and half
    assert all(a in ("Bearer r1", "Bearer r2") or a.startswith("Bearer unknown-") for a in bad)


def test_revoked_sends_only_the_files_revoked_tokens_again_and_again():
    bad = _bad_auths("revoked")
    assert 1800 < len(bad) < 2200
    assert set(bad) == {"Bearer r1", "Bearer r2"}


def test_unknown_sends_only_random_tokens_that_never_repeat():
    bad = _bad_auths("unknown")
    assert 1800 < len(bad) < 2200
    assert all(re.fullmatch(r"Bearer unknown-[0-9a-f]{16}", a) for a in bad)
    assert len(set(bad)) == len(bad)


def test_bad_tokens_kind_is_validated_naming_the_field():
    message = r"bad_tokens: expected one of mixed, revoked, unknown, got 'stale'"
    with pytest.raises(InvalidInput, match=message):
        TrafficSpec(bad_tokens="stale")


def test_revoked_needs_revoked_tokens_when_a_share_is_asked(tmp_path: Path):
    fresh = tmp_path / "fresh.json"
    fresh.write_text('{"tokens": [{"token": "a", "tenant": "x", "revoked": false}]}')
    message = "bad_tokens: 'revoked' with bad_token_share > 0 needs revoked tokens"
    for tokens_file in (str(fresh), None):
        config = LoadConfig(
            tokens_file=tokens_file,
            traffic=TrafficSpec(bad_tokens="revoked", bad_token_share=0.1),
            check_target=False,
        )
        with pytest.raises(InvalidInput, match=message):
            check_config(config)
    traffic = TrafficSpec(bad_tokens="revoked")
    check_config(LoadConfig(tokens_file=str(fresh), traffic=traffic, check_target=False))
    with pytest.raises(InvalidInput, match=message):
        TrafficModel(TrafficSpec(bad_token_share=0.1, bad_tokens="revoked"), [Tenant("a", "x")])


def test_cli_bad_tokens_flag_reaches_the_config(tmp_path: Path, capsys):
    fresh = tmp_path / "fresh.json"
    fresh.write_text('{"tokens": [{"token": "a", "tenant": "x", "revoked": false}]}')
    url = ["load", "--url", "http://127.0.0.1:9"]
    assert main([*url, "--bad-tokens", "stale"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--bad-tokens: expected one of mixed, revoked, unknown" in err and "\n" not in err
    args = ["--tokens", str(fresh), "--bad-token-share", "0.5", "--bad-tokens", "revoked"]
    assert main([*url, *args]) == 2
    assert "needs revoked tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_sends_the_bad_tokens_asked_for(fake_server, tmp_path: Path):
    server = fake_server()
    tokens = tmp_path / "tokens.json"
    entries = [
        {"token": "a", "tenant": "alpha"},
        {"token": "r", "tenant": "stale", "revoked": True},
    ]
    tokens.write_text(json.dumps({"tokens": entries}))
    config = LoadConfig(
        url=server.url,
        qps=100,
        duration_s=2.0,
        profile="constant",
        tokens_file=str(tokens),
        run_dir=str(tmp_path / "run"),
        drain_s=1.0,
        traffic=TrafficSpec(bad_token_share=0.5, bad_tokens="revoked"),
    )
    with LoadRun.start(config) as run:
        summary = run.wait()
    tenants: dict[str, int] = {}
    for line in run.timeline_path.read_text().splitlines():
        for name, n in json.loads(line)["tenants"].items():
            tenants[name] = tenants.get(name, 0) + n
    assert summary.ok == 200
    assert set(tenants) == {"alpha", "stale"}, tenants  # "mixed" would also send "unknown"
    assert 60 < tenants["stale"] < 140


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
