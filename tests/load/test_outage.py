"""Outage honesty and accounting with a dying target: the load never hides what happened."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmchaos.load import LoadConfig, LoadRun
from llmchaos.load.timeline import FAILURE_CLASSES
from llmchaos.load.traffic import TrafficSpec

from .conftest import REPO

pytestmark = pytest.mark.slow

RUN_S = 20.0
STALL_AT_S = 9.0  # after the server start: mid-run for both loads
STALL_S = 3.5
"""Over the 3 s frame-drop threshold with a margin: successes are placed on 100 ms slots, so a
stall of exactly 3 s showed as a 2.9 s gap now and then and the frame drop went uncounted."""


def closed_loop_locust(url: str, csv_prefix: Path, run_s: float) -> subprocess.Popen[bytes]:
    """Stock Locust: 10 FastHttpUsers x constant_throughput(10) = 100 req/s while all is well."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(REPO / "tests/load/closed_loop_locustfile.py"),
            "--headless",
            "-u",
            "10",
            "-r",
            "10",
            "-t",
            f"{run_s:.0f}s",
            "--host",
            url,
            "--csv",
            str(csv_prefix),
            "--only-summary",
            "--loglevel",
            "WARNING",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def locust_p99_ms(csv_prefix: Path) -> tuple[float, int]:
    with open(f"{csv_prefix}_stats.csv") as f:
        row = next(r for r in csv.DictReader(f) if r["Name"] == "Aggregated")
    return float(row["99%"]), int(row["Request Count"])


def test_open_loop_p99_covers_a_stall_that_closed_loop_locust_hides(fake_server, tmp_path):
    server = fake_server("--stall-at-s", str(STALL_AT_S), "--stall-s", str(STALL_S))
    config = LoadConfig(
        url=server.url,
        qps=100,
        duration_s=RUN_S,
        profile="constant",
        run_dir=str(tmp_path / "open"),
        drain_s=4.0,
    )
    closed = closed_loop_locust(server.url, tmp_path / "closed", RUN_S)
    try:
        with LoadRun.start(config) as run:
            summary = run.wait()
        closed.wait(timeout=RUN_S + 30)
    finally:
        if closed.poll() is None:
            closed.kill()
    closed_p99_ms, closed_count = locust_p99_ms(tmp_path / "closed")
    print(
        f"open loop: p99 {summary.latency_ms['p99']} ms of {summary.scheduled} requests; "
        f"closed loop: p99 {closed_p99_ms} ms of {closed_count} requests"
    )

    # Open loop: 3.5 s of a 20 s schedule were due during the stall, and they waited it out.
    assert summary.accounting_closed and summary.ok == summary.scheduled == 2000
    assert summary.latency_ms["p99"] >= 2500, summary.latency_ms
    assert summary.latency_ms["p50"] < 200
    assert summary.frame_drops >= 1  # ~3.5 s without a success
    # Closed loop: each user had one request stuck, then nothing was sent: a calm p99, under a
    # third of the stall (under 500 ms on a fast box; 700 ms on a slower one under 6 xdist
    # workers, where 1,046 were sent and the 10 stuck sat at the 99th percentile's edge).
    assert closed_count < 0.95 * 2000  # it sent less than asked (coordinated omission)
    assert closed_p99_ms < STALL_S * 1000 / 3, closed_p99_ms
    assert summary.latency_ms["p99"] > 3 * closed_p99_ms


def test_accounting_closes_when_the_target_dies_mid_run(fake_server, tmp_path):
    server = fake_server()
    config = LoadConfig(
        url=server.url,
        qps=150,
        duration_s=8.0,
        workers=2,
        run_dir=str(tmp_path / "run"),
        drain_s=3.0,
        traffic=TrafficSpec(stream_share=0.5),
    )
    with LoadRun.start(config) as run:
        start = run.wait_started()
        time.sleep(max(0.0, start + 3.0 - time.time()))
        server.kill()
        summary = run.wait()
    assert summary.accounting_closed
    failed = sum(summary.failed.values())
    assert summary.scheduled == summary.ok + failed + summary.dropped + summary.in_flight
    assert abs(summary.scheduled - 1200) < 5 * 1200**0.5
    assert 300 < summary.ok < 600  # about 3 s of 8 s answered
    assert summary.failed["connection"] > 500
    assert set(summary.failed) == set(FAILURE_CLASSES)
    assert summary.frame_drops == 1 and summary.frame_drop_s >= 4.5
    # The timeline holds every scheduled request too, second by second.
    lines = [json.loads(x) for x in run.timeline_path.read_text().splitlines()]
    assert sum(x["scheduled"] for x in lines) == summary.scheduled
    assert sum(x["ok"] for x in lines) == summary.ok
