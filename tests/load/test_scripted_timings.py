"""The load's TTFT, ITL, TPOT and e2e against a server whose timings are scripted: role chunk
at once, first content after T ms, then a token every D ms, usage at the end. Directly, and
through the embedded stack's HAProxy (which must not hold chunks back).

The arbiter is the wire (wire_clock.py): the kernel's times of the request and answer packets
on the loopback, which no process being scheduled late can move. The load's medians are held
within 2 ms or 2% of the wire's (the issue's bound); its TTFT and e2e count from the scheduled
send, so its median send lag (taken once the request is on the socket) is taken off them. On
an idle machine the wire is the script within a fraction of a millisecond (failures print all
three).

The load reads chunks with the kernel's receive time too, but one read takes what has arrived
and the kernel stamps it with its last packet's time: a load process kept from its core for
longer than a token's gap reads two chunks as one. With two busy loops beside it the medians
held within 1 ms (18 of 18 cases); beside the other tests on 4 xdist workers of a box whose
hypervisor took up to a core, the load's median ITL read 1.00 ms for 5, twice in a row. So
the test runs `solo`: it checks the load's clock, not a starved machine's (a chaos run's
summary says when its machine was short of CPU: `machine CPU`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from llmchaos.load import LoadConfig, LoadRun
from llmchaos.load.traffic import TrafficSpec
from tests.haproxy_front import haproxy_in_front
from tests.load.wire_clock import WireClock

pytestmark = [pytest.mark.slow, pytest.mark.solo]

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


def misses_against_the_wire(
    server_port: int, front: str, run_dir: Path, plan: dict[str, float]
) -> list[str]:
    """One load run against the wire: each median outside the bound, as a line."""
    with contextlib.ExitStack() as stack:
        url = f"http://127.0.0.1:{server_port}"
        if front == "haproxy":
            url = stack.enter_context(haproxy_in_front(server_port, run_dir / "haproxy"))
        wire = stack.enter_context(WireClock(int(url.rsplit(":", 1)[1])))
        measured = run_load(url, run_dir / "load")
    truth = wire.medians_ms()
    return [
        f"{name} p50: {measured[name]:.2f} ms, wire {truth[name]:.2f} ms (script {plan[name]} ms)"
        for name in plan
        if abs(measured[name] - truth[name]) > tolerance_ms(truth[name])
    ]


@pytest.mark.parametrize("front", ["direct", "haproxy"])
@pytest.mark.parametrize(("ttft_ms", "itl_ms"), [(20, 5), (100, 10), (250, 30)])
def test_load_timings_match_the_wire(
    fake_server, tmp_path: Path, needs_root: None, front: str, ttft_ms: float, itl_ms: float
) -> None:
    server = fake_server(
        *("--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms), "--tokens", str(TOKENS)),
        module="tests.load.scripted_server",
    )
    port = int(server.url.rsplit(":", 1)[1])
    plan = {"ttft": ttft_ms, "itl": itl_ms, "tpot": itl_ms, "e2e": ttft_ms + (TOKENS - 1) * itl_ms}
    # A miss is measured once more. Beside five other tests on CI's two cores a burst once put
    # the load's median TTFT 2.2 ms off the wire's (bound 2 ms). A bias (a front door that
    # buffers, a lag not taken off) misses in both runs.
    misses = misses_against_the_wire(port, front, tmp_path / "first", plan)
    if misses:
        again = misses_against_the_wire(port, front, tmp_path / "again", plan)
        assert not again, f"{front}: {'; '.join(misses)}; measured again: {'; '.join(again)}"
