"""Distributed load on 1, 2 and 3 network namespace "hosts" vs one local process: achieved
rate and requests per CPU-second per worker.

    .venv/bin/python bench/load_distributed.py [--qps-per-worker 1000] [--duration-s 20]
                                               [--hosts 1 2 3] [--rounds 1]   # root

Creates the namespace hosts (tests/load/netns_hosts.py: veth pairs to the root namespace, no
forwarding), starts nginx on the root namespace's address of the first veth (the fixed
completion of bench/load_open_loop.py), then per round:
1. one local process (`LoadRun`, workers=1: Locust's local runner, master and worker in one)
   at --qps-per-worker: the single-process figure;
2. for N in --hosts: a master in the root namespace (workers=0, remote_workers=N, bound to
   that address) and one `llmchaos load-worker` in each of N namespaces, N x --qps-per-worker
   in total, so every worker sends what the single process sent.
It prints achieved QPS against the target, and each worker's requests per CPU-second (its
process's user+system time; its requests: the answered requests of the run / N, the shares
being equal) side by side with the single-process figure, as a ratio (goal: >= 0.9). The
master's CPU is printed apart. Namespaces, nginx and every process are removed whatever
happens. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from load_open_loop import CpuMeter, start_nginx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' namespace hosts

from llmchaos.load import LoadConfig, LoadRun
from llmchaos.load.api import master_address
from llmchaos.load.traffic import TrafficSpec
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
        summary = run.wait()
    finally:
        cpu_s = meter.stop()
        run.close()
    answered = summary.ok + sum(summary.failed.values())
    return {"summary": summary, "per_cpu": [answered / cpu_s], "cpu_s": [cpu_s]}


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
    answered = summary.ok + sum(summary.failed.values())
    per_cpu = [answered / n / c for c in cpu_s]
    return {"summary": summary, "per_cpu": per_cpu, "cpu_s": cpu_s, "master_cpu_s": master_cpu_s}


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
        tmp = Path(name)
        nginx, url = start_nginx(tmp, host=hosts.address)
        try:
            for round_ in range(1, args.rounds + 1):
                print(f"round {round_}: single process ...", file=sys.stderr)
                rows.append((round_, "1 local process", run_single(url, args, tmp)))
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
        "req/CPU-s per worker (mean)       vs single  master CPU-s"
    )
    single = 0.0
    for round_, name, r in rows:
        s = r["summary"]
        mean = statistics.mean(r["per_cpu"])
        if name == "1 local process":
            single = mean
        each = " ".join(f"{x:.0f}" for x in r["per_cpu"])
        master = r.get("master_cpu_s")
        print(
            f"{round_:5d}  {name:18s} {s.target_qps:7.0f}  {s.achieved_qps:8.1f} "
            f"({100 * s.achieved_qps / s.target_qps:6.2f}%)  {s.lost_worker:5d}  "
            f"{s.accounting_closed!s:6s}  {each:>22s} ({mean:5.0f})  "
            f"{mean / single:8.3f}x  {'' if master is None else f'{master:.1f}'}"
        )
    print("goal: per-worker requests/CPU-s within 10% of the single process (ratio >= 0.9)")


if __name__ == "__main__":
    main()
