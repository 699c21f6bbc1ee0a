"""Live windows, control and /metrics of a running load; the library stays gevent-free."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from llmchaos.cli import main
from llmchaos.load import LoadConfig, LoadRun, Summary

pytestmark = pytest.mark.slow


def test_importing_the_library_does_not_monkey_patch():
    code = (
        "import sys, llmchaos.load, llmchaos.load.capacity, llmchaos.load.cli;"
        "assert 'gevent' not in sys.modules and 'locust' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_windows_follow_set_qps_and_bursts(fake_server, tmp_path):
    server = fake_server()
    config = LoadConfig(
        url=server.url,
        qps=50,
        duration_s=9.0,
        profile="constant",
        run_dir=str(tmp_path),
        drain_s=2.0,
    )
    with LoadRun.start(config) as run:
        start = run.wait_started()
        time.sleep(max(0.0, start + 3.5 - time.time()))
        run.set_qps(200)
        time.sleep(max(0.0, start + 6.5 - time.time()))
        run.inject_burst(duration_s=1.0, factor=5.0)
        # while the load surely runs: with both cores busy, a read after the window's came
        # once after its 9 s and drain, when the live endpoint was gone
        metrics = run.metrics_text()
        time.sleep(2.0)
        # read seconds later: at 3.5 s, beside other tests, one request of second 2 was
        # still in flight (99 of 100 answered)
        first = run.window(since_ts=start + 1, until_ts=start + 3)
        second = run.window(since_ts=start + 4, until_ts=start + 6)
        summary = run.wait()
    assert first["scheduled"] == 100 and first["ok"] == 100
    assert first["achieved_qps"] == pytest.approx(50, abs=1)
    assert first["latency_ms"]["p50"] > 5  # the fake server waits 5 ms
    assert first["serving_mode_share"] == {"gpu": 1.0}
    assert second["scheduled"] == pytest.approx(400, abs=2)
    # The burst: 5 x 200/s for 1 s from ~6.5 s, in a few Gamma-spaced waves (the part of the
    # window after the last wave sends nothing), on top of 200/s in seconds 6-8. Counted in
    # those seconds alone: on a busy box set_qps lands later than 3.5 s, and a total over the
    # run then once read an extra of 149.
    lines = [json.loads(line) for line in run.timeline_path.read_text().splitlines()]
    burst_seconds = [line["scheduled"] for line in lines if 6 <= line["t"] <= 8]
    burst_extra = sum(burst_seconds) - 200 * len(burst_seconds)
    assert len(burst_seconds) == 3 and 200 < burst_extra < 1500, burst_seconds
    assert summary.accounting_closed and summary.ok == summary.scheduled
    assert "llmchaos_load_scheduled_total" in metrics
    assert 'llmchaos_load_latency_ms{quantile="0.99"}' in metrics


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--qps", "0"], "--qps: expected a number > 0"),
        (["--qps", "-5"], "--qps: expected a number > 0"),
        (["--profile", "zigzag"], "--profile: unknown profile 'zigzag'"),
        (["--tokens", "/nonexistent/tokens.json"], "--tokens: cannot read"),
        (["--workers", "0"], "--workers: expected >= 1 local process, or --remote-workers"),
        (["--workers", "65"], "--workers: expected 0..64"),
        (["--remote-workers", "-1"], "--remote-workers: expected 0..64"),
        (["--master-port", "70000"], "--master-port: expected 0..65535"),
        (["--join-timeout-s", "0"], "--join-timeout-s: expected a number > 0"),
        (["--remote-workers", "1", "--master-bind-host", "192.0.2.7"], "cannot listen on"),
    ],
    ids=[
        "qps-zero",
        "qps-negative",
        "profile",
        "tokens",
        "workers",
        "workers-max",
        "remote",
        "port",
        "join",
        "bind",
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(fake_server, capsys, args, message):
    server = fake_server()
    assert main(["load", "--url", server.url, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_cli_url_that_does_not_answer_exits_2(capsys):
    assert main(["load", "--url", "http://127.0.0.1:9"]) == 2
    assert "--url: http://127.0.0.1:9 does not answer" in capsys.readouterr().err


def test_cli_run_writes_summary_and_timeline(fake_server, tmp_path, capsys):
    server = fake_server()
    summary_path, timeline_path = tmp_path / "s.json", tmp_path / "t.jsonl"
    code = main(
        [
            "load",
            "--url",
            server.url,
            "--qps",
            "40",
            "--duration",
            "3",
            "--profile",
            "constant",
            "--summary-json",
            str(summary_path),
            "--timeline",
            str(timeline_path),
            "--run-dir",
            str(tmp_path / "run"),
            *("--stream-share", "0.5", "--prompt-tokens", "uniform:4:8", "--context-tokens", "0"),
            *("--output-tokens", "4", "--ignore-eos", "--goodput", "ttft:2000", "e2el:2000"),
        ]
    )
    assert code == 0
    summary = json.loads(summary_path.read_text())
    for key in (
        "scheduled",
        "ok",
        "failed",
        "dropped",
        "achieved_qps",
        "goodput_qps",
        "output_tokens_per_s",
        "ran_s",
        "schedule_lag_p99_ms",
        "frame_drops",
    ):
        assert key in summary
    for key in ("latency_ms", "ttft_ms", "itl_ms", "tpot_ms"):
        assert set(summary[key]) == {"p50", "p90", "p99", "p999"}
        assert summary[key]["p50"] is not None, key  # the fake server streams 4 tokens
    assert summary["scheduled"] == summary["ok"] == 120
    assert summary["goodput_qps"] == summary["achieved_qps"] == 40.0  # all fast
    assert summary["ran_s"] == 3 and not summary["stopped_early"]
    lines = [json.loads(x) for x in timeline_path.read_text().splitlines()]
    assert [x["t"] for x in lines] == [0, 1, 2]
    assert all(x["scheduled"] == 40 for x in lines)
    assert json.loads(capsys.readouterr().out)["ok"] == 120


@pytest.mark.parametrize(("how", "workers"), [("stop", 1), ("sigterm", 1), ("sigterm", 2)])
def test_a_load_ended_early_reports_rates_over_the_time_it_ran(fake_server, tmp_path, how, workers):
    """A 60 s schedule ended after ~2 s, by the control (stop) or by SIGTERM to the process
    group: the summary is written and its rates divide by the seconds that ran (and were
    reported), not by the 60 planned."""
    server = fake_server()
    config = LoadConfig(
        url=server.url,
        qps=50,
        duration_s=60.0,
        profile="constant",
        workers=workers,
        run_dir=str(tmp_path / "run"),
        drain_s=2.0,
        goodput_e2e_ms=5000.0,
    )
    with LoadRun.start(config) as run:
        start = run.wait_started()
        time.sleep(max(0.0, start + 2.0 - time.time()))
        if how == "stop":
            summary = run.stop(timeout_s=20.0)
        else:
            os.killpg(run.process.pid, signal.SIGTERM)
            run.process.wait(timeout=20.0)
            summary = Summary.read(run.summary_path)
    assert summary.stopped_early and 0.9 <= summary.ran_s < 5.0, summary.ran_s
    assert summary.achieved_qps == pytest.approx(50, rel=0.15), summary
    assert summary.goodput_qps == pytest.approx(summary.achieved_qps, rel=0.05)
    assert summary.frame_drops == 0  # the planned rest of the schedule is not a gap


def test_locust_web_ui_is_served_during_an_open_loop_run(fake_server, tmp_path):
    server = fake_server()
    with socket.socket() as probe:  # a free port for the UI
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = LoadConfig(
        url=server.url,
        qps=50,
        duration_s=4.0,
        profile="constant",
        web_ui_port=port,
        run_dir=str(tmp_path),
        drain_s=1.0,
    )
    with LoadRun.start(config) as run:
        start = run.wait_started()
        time.sleep(max(0.0, start + 1.5 - time.time()))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
            status, kind, page = response.status, response.headers["Content-Type"], response.read()
        assert run.status()["state"] == "running"  # the UI answered while the load ran
        summary = run.wait()
    assert status == 200 and kind.startswith("text/html"), kind
    assert b"<html" in page.lower() and b"locust" in page.lower()
    assert summary.ok == summary.scheduled == 200


def test_seconds_give_live_records_that_become_the_timeline_lines(fake_server, tmp_path):
    server = fake_server("--delay-ms", "1000")  # answers take 1 s: recent seconds are open
    config = LoadConfig(
        url=server.url,
        qps=40,
        duration_s=4.0,
        profile="constant",
        run_dir=str(tmp_path),
        drain_s=3.0,
    )
    with LoadRun.start(config) as run:
        start = run.wait_started()
        time.sleep(max(0.0, start + 3.5 - time.time()))
        live = run.seconds(since_ts=start)
        one = run.seconds(since_ts=start + 1, until_ts=start + 2)
        summary = run.wait()
    lines = {x["t"]: x for x in map(json.loads, run.timeline_path.read_text().splitlines())}
    assert sorted(lines) == [0, 1, 2, 3]
    assert all(x["scheduled"] == 40 and x["unanswered"] == 0 for x in lines.values())
    assert summary.ok == summary.scheduled == 160
    assert [x["t"] for x in live] == list(range(len(live))) and len(live) >= 3, live
    assert [x["t"] for x in one] == [1]
    for x in live:
        assert set(x) == set(lines[x["t"]]) | {"final", "scheduled_in_full"}
        answered = x["ok"] + sum(x["failed"].values())
        assert x["unanswered"] == x["scheduled"] - x["dropped"] - answered
    # Second 0 was settled at 3.5 s: its record is already the line the file got.
    assert live[0] == {**lines[0], "final": True, "scheduled_in_full": True}
    assert any(not x["final"] and x["unanswered"] > 0 for x in live), live
    # read at 3.5 s (the worker reports every second): the seconds before its last report are
    # in full, the one under way is not
    in_full = [x["scheduled_in_full"] for x in live]
    assert in_full == sorted(in_full, reverse=True) and in_full[:2] == [True, True], live
    assert live[-1]["t"] == 3 and not live[-1]["scheduled_in_full"], live


def test_time_zero_is_sent_again_for_workers_that_registered_late() -> None:
    """A worker whose handler was not registered yet drops the first start message; without
    a resend its whole share of the schedule was lost (seen: half the requests missing).
    In a child process: importing the master's module imports Locust, which monkey-patches."""
    script = """
from types import SimpleNamespace
from llmchaos.load import process
process.START_DELAY_S, process.START_RESEND_S = 0.0, 0.6
sent = []
runner = SimpleNamespace(send_message=lambda *message: sent.append(message))
message = {"start_epoch_s": 42.0, "share": 1, "shares": 2}
process.Controller._announce(SimpleNamespace(env=SimpleNamespace(runner=runner)), "w1", message)
assert len(sent) >= 3, sent
assert all(m == ("llmchaos_start", message, "w1") for m in sent), sent
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
