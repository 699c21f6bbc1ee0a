"""`llmchaos compare` against two scripted providers whose errors, stalls and token counts are
known, so every figure of the table has a reference: the server's own script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import StackFactory
from llmchaos.errors import InvalidInput
from llmchaos.load.compare import figures_of, parse_endpoint
from llmchaos.load.histogram import LogHistogram
from llmchaos.stack.topology import Topology

from .conftest import REPO, FakeServer

STEP_S = 8.0
STALL_AT_S, STALL_S = 12.0, 4.0
EMBEDDED_STEP_S = 10.0
REQUESTS = "llmchaos_gateway_requests_total"


def test_two_providers_side_by_side(fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    # a: 10% 503 and 10% 429, 5 output tokens per answer; b: 5% 503 and one 4 s stall in the
    # second step (every request then waits for its end: one frame drop). Each its own key.
    a = fake_server(
        "--key", "key-a", "--fail-every", "503:10", "--fail-every", "429:10",
        "--completion-tokens", "5", "--delay-ms", "10",
    )  # fmt: skip
    b = fake_server(
        "--key", "key-b", "--fail-every", "503:20", "--stall-from-first",
        "--stall-at-s", str(STALL_AT_S), "--stall-s", str(STALL_S), "--delay-ms", "10",
    )  # fmt: skip
    out = tmp_path / "compare"
    argv = [sys.executable, "-m", "llmchaos.cli", "compare"]
    argv += ["--endpoint", f"a={a.url},key-env=KEY_A", "--endpoint", f"b={b.url},key-env=KEY_B"]
    argv += ["--start-qps", "20", "--step-qps", "20", "--max-qps", "40", "--step-s", str(STEP_S)]
    argv += ["--stream-share", "0", "--out", str(out)]
    env = {**os.environ, "KEY_A": "key-a", "KEY_B": "key-b"}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| P99 latency |" in done.stdout and "frame drops" in done.stdout
    for name in ("compare.json", "compare.md", "compare.svg", "compare.png"):
        assert (out / name).stat().st_size > 0
    data = json.loads((out / "compare.json").read_text())
    by_name = {e["endpoint"]["name"]: e for e in data["endpoints"]}
    assert "key-a" not in (out / "compare.json").read_text()  # the variable's name only

    whole_a, whole_b = by_name["a"]["whole"], by_name["b"]["whole"]
    for whole in (whole_a, whole_b):  # its own key each: not one 401
        assert whole["error_rate_by_class"]["other"] == 0.0
        assert whole["scheduled"] == pytest.approx(STEP_S * (20 + 40), rel=0.2)
    # every Nth request failed, counted from the first: the shares within one request
    one = 1.0 / whole_a["scheduled"]
    assert abs(whole_a["error_rate_by_class"]["5xx"] - 0.10) <= one
    assert abs(whole_a["error_rate_by_class"]["429"] - 0.10) <= one
    assert abs(whole_b["error_rate_by_class"]["5xx"] - 0.05) <= one
    assert whole_b["error_rate_by_class"]["429"] == 0.0
    assert whole_a["error_rate_by_class"]["timeout"] == whole_b["error_rate_by_class"]["timeout"]
    # tokens/s: 5 per success, over the schedule
    assert whole_a["tokens_per_s"] == pytest.approx(5 * whole_a["ok"] / (2 * STEP_S), rel=0.01)
    # a never stalls; b's stall is one frame drop of about its length, in the second step. A
    # P99 under half the stall tells none from it (on CI's busy box, with the other tests on
    # three more workers, a's P99 at 10 ms per answer was 724 ms once)
    no_stall_ms = STALL_S * 1000 / 2
    assert whole_a["frame_drops"] == 0 and whole_a["p99_ms"] < no_stall_ms
    steps_b = by_name["b"]["steps"]
    assert [s["frame_drops"] for s in steps_b] == [0, 1]
    events = by_name["b"]["summary"]["frame_drop_events"]
    assert len(events) == 1
    start_s, length_s = events[0]
    assert STALL_AT_S - 0.5 <= start_s <= STALL_AT_S + 0.3
    assert STALL_S - 0.5 <= length_s <= STALL_S + 0.5
    # requests scheduled in the stall wait for its end: latencies uniform over (0, 4 s], a
    # third of the successes; the top 1% of all is the top 3% of those
    assert 0.9 * STALL_S * 1000 <= whole_b["p99_ms"] <= 1.05 * STALL_S * 1000
    assert steps_b[0]["p99_ms"] < no_stall_ms


def _line(t: int, ok: int, failed: dict[str, int], latency_ms: list[float]) -> dict[str, Any]:
    hist = LogHistogram()
    for value in latency_ms:
        hist.add(value)
    return {
        "t": t,
        "scheduled": ok + sum(failed.values()),
        "dropped": 0,
        "ok": ok,
        "good": ok,
        "output_tokens": 2 * ok,
        "failed": dict(Counter(failed)),
        "modes": {},
        "tenants": {},
        "hist": {"latency_ms": hist.to_json()},
    }


def test_figures_split_steps_and_space_frame_drops() -> None:
    lines = [
        _line(0, 9, {"5xx": 1}, [10.0] * 10),
        _line(1, 8, {"timeout": 1, "429": 1}, [20.0] * 9 + [8000.0]),
        _line(2, 10, {}, [30.0] * 10),
    ]
    events = [[0.5, 3.0], [10.0, 4.0], [20.5, 3.5]]
    first = figures_of(lines, events, 0.0, 2.0, qps=10.0)
    assert (first.scheduled, first.ok, first.qps) == (20, 17, 10.0)
    assert first.error_rate_by_class == {"5xx": 0.05, "timeout": 0.05, "429": 0.05, "other": 0.0}
    assert first.error_rate == 0.15
    assert first.tokens_per_s == 17.0
    assert first.frame_drops == 1 and first.frame_drop_spacing_s is None
    whole = figures_of(lines, events, 0.0, 30.0)
    assert whole.frame_drops == 3 and whole.frame_drop_spacing_s == 10.0
    assert whole.p99_ms == pytest.approx(8000.0, rel=0.01)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("a", "expected NAME=URL"),
        ("a=ftp://x", "expected NAME=URL"),
        ("a b=http://x", "letters, digits"),
        ("a=http://x,key=K", "unknown or empty option 'key=K'"),
        ("a=http://x,key-env=K,tokens=t.json", "not both"),
    ],
)
def test_bad_endpoints_are_refused_with_the_flag(text: str, problem: str) -> None:
    with pytest.raises(InvalidInput, match="--endpoint") as info:
        parse_endpoint(text)
    assert problem in str(info.value)


def test_a_missing_key_variable_stops_before_any_load(
    fake_server: Callable[..., FakeServer], tmp_path: Path
) -> None:
    a = fake_server()
    argv = [sys.executable, "-m", "llmchaos.cli", "compare", "--out", str(tmp_path / "x")]
    argv += ["--endpoint", f"a={a.url},key-env=LLMCHAOS_NO_SUCH_KEY", "--endpoint", f"b={a.url}"]
    env = {k: v for k, v in os.environ.items() if k != "LLMCHAOS_NO_SUCH_KEY"}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--api-key-env: the environment variable 'LLMCHAOS_NO_SUCH_KEY' is not set" in (
        done.stderr
    )
    assert not (tmp_path / "x" / "a" / "locust.log").exists()


def _gateway_count(topology: Topology, name: str, **labels: str) -> float:
    """Sum over the stack's gateways of the samples `name` with `labels`: the server's own
    count, the reference for the client's."""
    total = 0.0
    for gateway in topology.gateways:
        with urllib.request.urlopen(gateway.url + "/metrics", timeout=5) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
    return total


@pytest.mark.slow
def test_two_embedded_stacks_hardened_against_late_degradation(
    stack_factory: StackFactory, tmp_path: Path
) -> None:
    # The same stepped overload, at once (the soak's stacks: batches of 32, degraded at 100
    # queued) against the hardened stack, which sheds with 429 past the threshold, and
    # late-degradation, whose queue grows towards the shed limit of 1000: requests wait past
    # the timeout, then a frame drop.
    overload = {"gpu_max_num_seqs": 32, "degradation_queue_threshold": 100}
    stacks = {
        "hardened": stack_factory(variant="hardened", **overload),
        "late": stack_factory(variant="late-degradation", **overload),
    }
    out = tmp_path / "compare"
    argv = [sys.executable, "-m", "llmchaos.cli", "compare", "--mode", "parallel"]
    for name, topology in stacks.items():
        argv += ["--endpoint", f"{name}={topology.gateway_url},tokens={topology.tokens_file}"]
    argv += ["--start-qps", "40", "--step-qps", "40", "--max-qps", "120"]
    argv += ["--step-s", str(EMBEDDED_STEP_S), "--stream-share", "0", "--out", str(out)]
    argv += ["--prompt-tokens", "64", "--output-tokens", "64", "--model", stacks["late"].model]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "compare.md").read_text() in done.stdout  # the table printed is the one written
    data = json.loads((out / "compare.json").read_text())
    by_name = {e["endpoint"]["name"]: e for e in data["endpoints"]}

    # the client's counts against the gateways' own: every 429 the client got is one the
    # gateways sent; every success a 200 there (a 200 may also have gone to a client that
    # had given up: a timeout here)
    for name, topology in stacks.items():
        failed, ok = by_name[name]["summary"]["failed"], by_name[name]["summary"]["ok"]
        assert failed["429"] == _gateway_count(topology, REQUESTS, code="429"), name
        sent_200 = _gateway_count(topology, REQUESTS, code="200")
        assert ok <= sent_200 <= ok + failed["timeout"], (name, ok, sent_200, failed)
    # the same first step, served alike; then hardened sheds (429) where late times out
    hardened, late = by_name["hardened"], by_name["late"]
    for endpoint in (hardened, late):
        assert endpoint["steps"][0]["error_rate"] == 0.0, endpoint["steps"][0]
    assert hardened["steps"][-1]["error_rate_by_class"]["429"] > 0.05, hardened["steps"][-1]
    timeouts = [e["whole"]["error_rate_by_class"]["timeout"] for e in (hardened, late)]
    assert timeouts[1] > max(5 * timeouts[0], 0.05), timeouts
    assert late["whole"]["error_rate"] > hardened["whole"]["error_rate"] + 0.1
    assert late["whole"]["frame_drops"] >= hardened["whole"]["frame_drops"]
