"""Distributed load on 1, 2 and 3 network namespace "hosts" vs one local process: achieved
rate and requests per CPU-second per worker.

    .venv/bin/python bench/load_distributed.py [--qps-per-worker 1000] [--duration-s 20]
                                               [--hosts 1 2 3] [--rounds 1]   # root

Creates the namespace hosts (tests/load/netns_hosts.py: veth pairs to the root namespace, no
forwarding), starts nginx on the root namespace's address of the first veth (the fixed
completion of bench/load_open_loop.py), then per round:
1. one local process (`LoadRun`, workers=1: Locust's local runner, master and worker in one)
   at --qps-per-worker: the single-process figure;
2. the same process inside the first namespace host (`ip netns exec`): what the veth path
   alone costs, without the distributed mode;
3. for N in --hosts: a master in the root namespace (workers=0, remote_workers=N, bound to
   that address) and one `llmchaos load-worker` in each of N namespaces, N x --qps-per-worker
   in total, so every worker sends what the single process sent.
It prints achieved QPS against the target, and each worker's requests per CPU-second (its
process's user+system time from time zero to its end; its requests: the answered requests of
the run / N, the shares being equal) side by side with the single-process figure, as a ratio
(goal: >= 0.9); and the same over the whole process, start-up included (Python and Locust
imports, and for a worker the `llmchaos` command before it becomes Locust: ~0.4 CPU-s each,
whatever the run's length). The master's CPU is printed apart. Namespaces, nginx and every
process are removed whatever happens. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from load_open_loop import CpuMeter, start_nginx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' namespace hosts

from llmchaos.load import LoadConfig, LoadRun, Summary
from llmchaos.load.api import locust_command, master_address
from llmchaos.load.traffic import TrafficSpec
from llmchaos.load.wire import LIVE_FILE
from tests.load.netns_hosts import NamespaceHosts, namespace_hosts

LLMCHAOS = str(Path(sys.executable).with_name("llmchaos"))


def _config(url: str, qps: float, args: argparse.Namespace, run_dir: Path, **more) -> LoadConfig:
    return LoadConfig(
        url=url,
        qps=qps,
        duration_s=args.duration_s,
        profile="poisson",
        run_dir=str(run_dir),
        drain_s=3.0,
        traffic=TrafficSpec(stream_share=0.0),
        **more,
    )


def run_single(url: str, args: argparse.Namespace, tmp: Path) -> dict:
    run = LoadRun.start(_config(url, args.qps_per_worker, args, tmp / "single"))
    meter = CpuMeter(run.process.pid)
    try:
        at_zero = _at_time_zero(run, [meter])
        summary = run.wait()
    finally:
        cpu_s = meter.stop()
        run.close()
    return _result(summary, 1, [cpu_s], at_zero)


def run_single_in_host(url: str, hosts: NamespaceHosts, args: argparse.Namespace, tmp: Path):
    run_dir = tmp / "single-ns"
    run_dir.mkdir(parents=True, exist_ok=True)
    # its live endpoint on the namespace's address, which the root namespace reaches
    config = replace(
        _config(url, args.qps_per_worker, args, run_dir), live_host=hosts.nets[0].address
    )
    with (run_dir / "locust.log").open("wb") as log:
        process = subprocess.Popen(
            hosts.exec_argv(0, locust_command(config)),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    run: LoadRun | None = None
    meter = CpuMeter(process.pid)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / LIVE_FILE).exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the load in the namespace did not start: {run_dir}")
            time.sleep(0.1)
        run = LoadRun(config, process, json.loads((run_dir / LIVE_FILE).read_text())["url"])
        at_zero = _at_time_zero(run, [meter])
        summary = run.wait()
    finally:
        cpu_s = meter.stop()
        if run is not None:
            run.close()
        elif process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    return _result(summary, 1, [cpu_s], at_zero)


def _at_time_zero(run: LoadRun, meters: list[CpuMeter]) -> list[float]:
    """Each meter's CPU seconds at the schedule's time zero (the processes wait idle then)."""
    start = run.wait_started()
    time.sleep(max(0.0, start - time.time()))
    return [meter.total() for meter in meters]


def _result(summary: Summary, n: int, cpu_s: list[float], at_zero: list[float], **more) -> dict:
    answered = (summary.ok + sum(summary.failed.values())) / n
    return {
        "summary": summary,
        "per_cpu": [answered / (c - z) for c, z in zip(cpu_s, at_zero, strict=True)],
        "per_cpu_whole": [answered / c for c in cpu_s],
        **more,
    }


def run_hosts(url: str, hosts: NamespaceHosts, n: int, args: argparse.Namespace, tmp: Path):
    config = _config(
        url,
        args.qps_per_worker * n,
        args,
        tmp / f"hosts{n}",
        workers=0,
        remote_workers=n,
        master_bind_host=hosts.address,
        join_timeout_s=60.0,
    )
    workers: list[subprocess.Popen[bytes]] = []
    meters: list[CpuMeter] = []
    run = LoadRun.start(config)
    master = CpuMeter(run.process.pid)
    try:
        for index in range(n):
            argv = hosts.exec_argv(
                index, [LLMCHAOS, "load-worker", "--master", master_address(run.config)]
            )
            workers.append(
                subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
            meters.append(CpuMeter(workers[-1].pid))
        at_zero = _at_time_zero(run, meters)
        summary = run.wait(timeout_s=args.duration_s + 120)
        for worker in workers:
            worker.wait(timeout=30)
    finally:
        cpu_s = [meter.stop() for meter in meters]
        master_cpu_s = master.stop()
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=10)
        run.close()
    return _result(summary, n, cpu_s, at_zero, master_cpu_s=master_cpu_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qps-per-worker", type=float, default=1000.0)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    rows: list[tuple[int, str, dict]] = []
    with (
        tempfile.TemporaryDirectory(prefix="llmchaos-bench-") as name,
        namespace_hosts(max(args.hosts)) as hosts,
    ):
        nginx, url = start_nginx(Path(name), host=hosts.address)
        try:
            for round_ in range(1, args.rounds + 1):
                tmp = Path(name) / f"round{round_}"  # each run its own folder
                print(f"round {round_}: single process ...", file=sys.stderr)
                rows.append((round_, "1 local process", run_single(url, args, tmp)))
                print(f"round {round_}: single process in a namespace ...", file=sys.stderr)
                result = run_single_in_host(url, hosts, args, tmp)
                rows.append((round_, "1 process in netns", result))
                for n in args.hosts:
                    print(f"round {round_}: {n} namespace hosts ...", file=sys.stderr)
                    result = run_hosts(url, hosts, n, args, tmp)
                    rows.append((round_, f"{n} namespace hosts", result))
        finally:
            nginx.terminate()
            nginx.wait(timeout=10)
    print(
        f"poisson, {args.qps_per_worker:.0f} QPS per worker x {args.duration_s:.0f} s, "
        "plain answers from nginx on the first veth's root address"
    )
    print(
        "round  load                target  achieved (%)          lost  closed  "
        "req/CPU-s per worker from time zero (mean)  vs single  | whole process  vs single"
        "  master CPU-s"
    )
    single = single_whole = 0.0
    for round_, name, r in rows:
        s = r["summary"]
        mean, whole = statistics.mean(r["per_cpu"]), statistics.mean(r["per_cpu_whole"])
        if name == "1 local process":
            single, single_whole = mean, whole
        each = " ".join(f"{x:.0f}" for x in r["per_cpu"])
        master = r.get("master_cpu_s")
        print(
            f"{round_:5d}  {name:18s} {s.target_qps:7.0f}  {s.achieved_qps:8.1f} "
            f"({100 * s.achieved_qps / s.target_qps:6.2f}%)  {s.lost_worker:5d}  "
            f"{s.accounting_closed!s:6s}  {each:>22s} ({mean:5.0f})  {mean / single:14.3f}x"
            f"  | {whole:13.0f}  {whole / single_whole:8.3f}x"
            f"  {'-' if master is None else f'{master:.1f}'}"
        )
    print("median over the rounds of each load's ratio to its round's single process:")
    singles = {round_: statistics.mean(r["per_cpu"]) for round_, name, r in rows if "local" in name}
    by_load: dict[str, list[float]] = {}
    for round_, name, r in rows:
        by_load.setdefault(name, []).append(statistics.mean(r["per_cpu"]) / singles[round_])
    for name, ratios in by_load.items():
        print(f"  {name:18s} {statistics.median(ratios):.3f}x  (rounds: ", end="")
        print(" ".join(f"{x:.3f}" for x in ratios) + ")")
    print("goal: per-worker requests/CPU-s within 10% of the single process (ratio >= 0.9)")


if __name__ == "__main__":
    main()
