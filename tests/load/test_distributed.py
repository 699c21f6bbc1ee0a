"""Distributed load over real TCP between network namespace "hosts" on this machine: the master
in the root namespace, one `llmchaos load-worker` per namespace, one killed mid-run (root)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llmchaos.load import LoadConfig, LoadRun
from llmchaos.load.api import master_address
from llmchaos.load.traffic import TrafficSpec
from tests.load.netns_hosts import namespace_hosts

REPO = Path(__file__).resolve().parents[2]
LLMCHAOS = str(Path(sys.executable).with_name("llmchaos"))
QPS = 60.0
DURATION_S = 10.0
KILL_AT_S = 3.0


def _config(url: str, tmp_path: Path, **settings: Any) -> LoadConfig:
    """A constant schedule (exact counts per share) of plain answers (fewer packets)."""
    return LoadConfig(
        url=url,
        profile="constant",
        drain_s=2.0,
        run_dir=str(tmp_path / "run"),
        traffic=TrafficSpec(stream_share=0.0),
        **settings,
    )


def _closes(record: dict) -> bool:
    answered = record["ok"] + sum(record["failed"].values())
    rest = record["dropped"] + record["lost_worker"] + record["unanswered"]
    return record["scheduled"] == answered + rest


def test_three_namespace_hosts_one_killed_mid_run_accounting_closes(
    needs_netns, fake_server, tmp_path
):
    """Three workers on three namespace hosts share a constant 60 QPS for 10 s (20/s each);
    the worker of one is SIGKILLed at 3 s. The run ends on its own, every second and the run
    close with the dead worker's unsent arrivals as their own class (lost_worker, also in the
    live /seconds), that class is its share of the rest of the schedule, and the two
    survivors' requests are all answered."""
    with namespace_hosts(3) as hosts:
        server = fake_server("--delay-ms", "2", host=hosts.address)
        config = _config(
            server.url,
            tmp_path,
            qps=QPS,
            duration_s=DURATION_S,
            workers=0,
            remote_workers=3,
            master_bind_host=hosts.address,
            join_timeout_s=60.0,
        )
        workers: list[subprocess.Popen[bytes]] = []
        with LoadRun.start(config) as run:
            try:
                for index in range(3):
                    log = (tmp_path / f"worker{index}.log").open("wb")
                    argv = [LLMCHAOS, "load-worker", "--master", master_address(run.config)]
                    workers.append(
                        subprocess.Popen(
                            hosts.exec_argv(index, argv), cwd=REPO, stdout=log, stderr=log
                        )
                    )
                start = run.wait_started(timeout_s=90.0)
                time.sleep(max(0.0, start + KILL_AT_S - time.time()))
                killed = workers[1]
                os.kill(killed.pid, signal.SIGKILL)
                killed_at_s = time.time() - start
                live = _seconds_once_lost(run, start, until_ts=start + DURATION_S)
                metrics = run.metrics_text()
                summary = run.wait(timeout_s=60.0)
                # the survivors leave when their master quits
                for worker in workers:
                    worker.wait(timeout=30.0)
            finally:
                for worker in workers:
                    if worker.poll() is None:
                        worker.kill()
                        worker.wait(timeout=10.0)

    assert summary.accounting_closed, summary
    assert summary.scheduled == QPS * DURATION_S  # the whole plan, whatever happened
    assert summary.scheduled == (
        summary.ok
        + sum(summary.failed.values())
        + summary.dropped
        + summary.in_flight
        + summary.lost_worker
    )
    shares = {w["share"]: w for w in summary.workers}
    assert sorted(shares) == [0, 1, 2]
    lost = [w for w in summary.workers if w["state"] == "lost"]
    assert len(lost) == 1, summary.workers
    dead = lost[0]
    assert dead["lost_reason"] in ("missing", "quit"), dead
    assert dead["lost_worker"] == summary.lost_worker
    per_worker_qps = QPS / 3
    # its share of the schedule after its last report: everything after the kill, and before
    # it what it had not reported yet (reports every 1 s; a busy box delays them)
    remaining = per_worker_qps * (DURATION_S - killed_at_s)
    assert remaining - 2 <= dead["lost_worker"] <= remaining + per_worker_qps * 3, (
        dead,
        killed_at_s,
    )
    for share in summary.workers:
        assert share["scheduled"] == per_worker_qps * DURATION_S, share
        counted = share["ok"] + share["failed"] + share["dropped"] + share["unanswered"]
        assert share["scheduled"] == counted + share["lost_worker"], share
        if share is not dead:
            assert share["state"] == "done" and share["lost_worker"] == 0, share
            assert share["ok"] == share["scheduled"], share  # every request answered

    lines = [json.loads(x) for x in run.timeline_path.read_text().splitlines()]
    assert [x["t"] for x in lines] == list(range(int(DURATION_S)))
    assert all(_closes(x) for x in lines), lines
    assert sum(x["lost_worker"] for x in lines) == summary.lost_worker
    # after its death was noticed (a few s of heartbeats) every second holds its full share
    assert lines[-1]["lost_worker"] == per_worker_qps, lines[-1]
    assert all(_closes(x) for x in live), live
    assert any(x["lost_worker"] > 0 for x in live), live
    lost_metric = [x for x in metrics.splitlines() if x.startswith("llmchaos_load_lost_worker_")]
    assert lost_metric and float(lost_metric[0].split()[-1]) > 0, metrics
    assert not hosts_left(hosts.namespaces)


def _seconds_once_lost(run: LoadRun, start: float, until_ts: float) -> list[dict]:
    """The live records once one of them counts lost arrivals (Locust notices a dead worker
    after ~4 s without heartbeats), or at `until_ts`."""
    while True:
        live = run.seconds(since_ts=start)
        if any(x["lost_worker"] for x in live) or time.time() >= until_ts:
            return live
        time.sleep(0.25)


def hosts_left(names: list[str]) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [name for name in names if name in listed]


def test_a_worker_that_never_joins_is_counted_and_a_late_one_gets_no_share(fake_server, tmp_path):
    """One local process and one remote worker expected, the remote one not there when the
    join timeout ends: the run starts with the local one, the missing share is lost_worker
    from time zero, exactly its half of the plan. A worker that joins after time zero gets no
    share, sends nothing, and leaves when the master quits."""
    server = fake_server("--delay-ms", "2")
    config = _config(
        server.url, tmp_path, qps=20.0, duration_s=3.0, remote_workers=1, join_timeout_s=2.0
    )
    with LoadRun.start(config) as run:
        run.wait_started(timeout_s=60.0)
        # on a busy box it can start after the 3 s run and its master are over: it must not
        # then wait the default 60 s for a master that is gone
        late = subprocess.Popen(
            [
                LLMCHAOS,
                "load-worker",
                "--master",
                master_address(run.config),
                "--connect-timeout-s",
                "10",
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            summary = run.wait(timeout_s=60.0)
            late.wait(timeout=30.0)
        finally:
            if late.poll() is None:
                late.kill()
                late.wait(timeout=10.0)
    assert summary.accounting_closed and summary.scheduled == 60
    assert summary.ok == 30 and summary.lost_worker == 30, summary
    states = [(w["share"], w["state"], w["lost_reason"]) for w in summary.workers]
    assert states == [(0, "done", None), (1, "lost", "never joined")], summary.workers


def test_no_worker_at_all_ends_the_run_with_the_whole_plan_lost(fake_server, tmp_path):
    server = fake_server()
    config = _config(
        server.url,
        tmp_path,
        qps=10.0,
        duration_s=5.0,
        workers=0,
        remote_workers=2,
        join_timeout_s=1.0,
    )
    with LoadRun.start(config) as run:
        summary = run.wait(timeout_s=60.0)
    assert summary.accounting_closed
    assert summary.scheduled == summary.lost_worker == 50 and summary.ok == 0
    assert [w["lost_reason"] for w in summary.workers] == ["never joined"] * 2


def test_load_worker_without_a_master_gives_up_with_a_message(capsys):
    from llmchaos.cli import main
    from llmchaos.stack.procs import free_port

    master = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert main(["load-worker", "--master", master, "--connect-timeout-s", "1"]) != 0
    assert time.monotonic() - started < 10
    assert f"nothing listens on {master}" in capsys.readouterr().err
    assert main(["load-worker", "--master", "nohost"]) == 2
    assert "--master: expected HOST:PORT" in capsys.readouterr().err
    for bad in ("inf", "nan", "-1"):
        assert main(["load-worker", "--master", master, "--connect-timeout-s", bad]) == 2
        assert "--connect-timeout-s: expected a number of seconds >= 0" in capsys.readouterr().err


def test_load_worker_whose_master_stops_answering_gives_up_within_its_connect_timeout() -> None:
    """Something listens at --master but no Locust master answers (one that quit just after
    the worker saw it listening): Locust's own 60 tries of 5 s kept such a worker 5 min; it
    now gives up after --connect-timeout-s, rounded up to one 5-s try."""
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never speaks ZMTP
    try:
        master = f"127.0.0.1:{listener.getsockname()[1]}"
        worker = subprocess.Popen(
            [LLMCHAOS, "load-worker", "--master", master, "--connect-timeout-s", "2"],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        started = time.monotonic()
        try:
            _, err = worker.communicate(timeout=40.0)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.communicate(timeout=10.0)
        took_s = time.monotonic() - started
    finally:
        listener.close()
    assert worker.returncode != 0 and took_s < 25, (worker.returncode, took_s)
    assert "Failed to connect to the Locust master" in err, err[-2000:]


def test_a_stopped_run_counts_a_lost_share_up_to_the_stop_only(fake_server, tmp_path):
    """A 60 s plan stopped after ~2 s: the share of the worker that never joined is counted
    until the stop (its 10/s), not to the planned end (600)."""
    server = fake_server("--delay-ms", "2")
    config = _config(
        server.url, tmp_path, qps=20.0, duration_s=60.0, remote_workers=1, join_timeout_s=1.0
    )
    with LoadRun.start(config) as run:
        start = run.wait_started(timeout_s=60.0)
        time.sleep(max(0.0, start + 2.0 - time.time()))
        summary = run.stop(timeout_s=60.0)
    assert summary.accounting_closed and summary.stopped_early
    lost = summary.workers[1]
    assert lost["lost_reason"] == "never joined"
    assert lost["lost_worker"] == summary.lost_worker
    assert abs(summary.lost_worker - 10 * summary.ran_s) <= 2, summary
    assert abs(summary.workers[0]["ok"] - summary.lost_worker) <= 2, summary.workers
