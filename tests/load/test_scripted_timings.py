"""The load's TTFT, ITL, TPOT and e2e against a server whose timings are scripted: role chunk
at once, first content after T ms, then a token every D ms, usage at the end. Directly, and
through the embedded stack's HAProxy (which must not hold chunks back).

The arbiter is the wire (wire_clock.py): the kernel's times of the request and answer packets
on the loopback, which no process being scheduled late can move, so the test holds on a busy
machine too. The load's medians are held within 2 ms or 2% of the wire's (the issue's bound);
its TTFT and e2e count from the scheduled send, so its median send lag (taken once the
request is on the socket) is taken off them. On an idle machine the wire is the script within
a fraction of a millisecond (failures print all three).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmchaos.load import LoadConfig, LoadRun
from llmchaos.load.traffic import TrafficSpec
from tests.haproxy_front import haproxy_in_front
from tests.load.wire_clock import WireClock

pytestmark = pytest.mark.slow

TOKENS = 8


def tolerance_ms(expected_ms: float) -> float:
    """The issue's bound: 2 ms or 2%, whichever is larger, on the median. (The tail is not
    held to it: on a busy 2-core machine some wake-ups come 5-10 ms late, in the load, the
    server and HAProxy alike; a front door that buffers delays every answer by ~130 ms.)"""
    return max(2.0, 0.02 * expected_ms)


def run_load(url: str, run_dir: Path) -> dict[str, float]:
    """Medians of the load's figures, TTFT and e2e less its median send lag."""
    config = LoadConfig(
        url=url,
        qps=20,
        duration_s=4,
        profile="constant",
        run_dir=str(run_dir),
        traffic=TrafficSpec(
            stream_share=1.0, context_tokens=0, prompt_tokens="4", output_tokens=str(TOKENS)
        ),
    )
    with LoadRun.start(config) as run:
        summary = run.wait()
    assert summary.ok == summary.scheduled == 80, summary
    # TTFT and e2e count from the scheduled send time, and the server cannot see how late
    # the send was: the load's own median send lag (~0.6 ms, its 1 ms send tick and wake-ups)
    # is taken off them. ITL and TPOT have no lag.
    lag_ms = float(summary.schedule_lag_ms["p50"] or 0.0)
    return {
        "ttft": float(summary.ttft_ms["p50"] or 0.0) - lag_ms,
        "itl": float(summary.itl_ms["p50"] or 0.0),
        "tpot": float(summary.tpot_ms["p50"] or 0.0),
        "e2e": float(summary.latency_ms["p50"] or 0.0) - lag_ms,
    }


@pytest.fixture
def needs_root() -> None:
    """The wire clock needs a packet socket (root), as the stack's namespaces do."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("CI runs as root and must check the load against the wire")
        pytest.skip("a packet socket on lo needs root")


@pytest.mark.parametrize("front", ["direct", "haproxy"])
@pytest.mark.parametrize(("ttft_ms", "itl_ms"), [(20, 5), (100, 10), (250, 30)])
def test_load_timings_match_the_wire(
    fake_server, tmp_path: Path, needs_root: None, front: str, ttft_ms: float, itl_ms: float
) -> None:
    server = fake_server(
        *("--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms), "--tokens", str(TOKENS)),
        module="tests.load.scripted_server",
    )
    if front == "direct":
        with WireClock(int(server.url.rsplit(":", 1)[1])) as wire:
            measured = run_load(server.url, tmp_path / "load")
    else:
        with (
            haproxy_in_front(int(server.url.rsplit(":", 1)[1]), tmp_path / "haproxy") as url,
            WireClock(int(url.rsplit(":", 1)[1])) as wire,
        ):
            measured = run_load(url, tmp_path / "load")
    truth = wire.medians_ms()
    plan = {"ttft": ttft_ms, "itl": itl_ms, "tpot": itl_ms, "e2e": ttft_ms + (TOKENS - 1) * itl_ms}
    misses = [
        f"{name} p50: {measured[name]:.2f} ms, wire {truth[name]:.2f} ms (script {plan[name]} ms)"
        for name in plan
        if abs(measured[name] - truth[name]) > tolerance_ms(truth[name])
    ]
    assert not misses, f"{front}: " + "; ".join(misses)
