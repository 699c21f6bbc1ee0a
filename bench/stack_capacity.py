"""Capacity of the embedded stack's full path (HAProxy -> gateway -> worker) on this machine.

    .venv/bin/python bench/stack_capacity.py [--qps 250,500,1000,1250,1500] [--step-s 15]
                                             [--traffic short|field] [--load-workers 1]
                                             [--active-gateways 1] [--fleet-for QPS]

Starts the default (hardened) stack, then for each QPS step runs the open-loop load
(`llmchaos.load.LoadRun`, on the same machine) for --step-s seconds and prints achieved QPS,
P99, error rate and the CPU each component used (cores, from /proc via psutil), under it the
part of that spent in the kernel (system time), and the whole machine's user, system, softirq
and idle time (softirq, much of loopback TCP, may be in no process's time). The answer is
the highest step with P99 under 2 s and errors under 1%. Traffic `short` (10-token prompts, 4
output tokens) measures the software path; `field` (the load's defaults, TrafficSpec: Zipf
prompts over a 512-token template, median 8 output tokens (log-normal, at most 1024), 30%
streaming) is bound by the two simulated GPUs instead, unless `--fleet-for QPS` lays the stack
out for that rate of the field traffic (llmchaos.stack.fleet, as `stack up --qps`). Not a test:
figures for the README.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

from llmchaos.load import LoadConfig, LoadRun
from llmchaos.load.traffic import TrafficSpec
from llmchaos.stack.config import StackConfig
from llmchaos.stack.fleet import DEFAULT_TRAFFIC, plan_fleet
from llmchaos.stack.stack import start_stack, stop_stack
from llmchaos.stack.topology import Topology, read_agent_state

P99_LIMIT_MS = 2000.0
ERROR_LIMIT = 0.01
TRAFFIC = {
    "short": {
        "prompt_min_tokens": 10,
        "prompt_max_tokens": 10,
        "context_tokens": 0,
        "output_median_tokens": 4,
        "output_max_tokens": 4,
        "stream_share": 0.0,
    },
    "field": {},
}


def component_pids(topology: Topology) -> dict[str, list[int]]:
    pids: dict[str, list[int]] = {
        "haproxy": [topology.haproxy_pid],
        "redis": [topology.redis_pid],
    }
    for gateway in topology.gateways:
        pids[gateway.name] = [gateway.pid]
    for node in topology.nodes:
        state = read_agent_state(Path(node.agent_state_path))
        for name, worker in (state.workers if state else {}).items():
            pids[name] = [worker.pid]
        pids.setdefault("agents", []).append(node.agent_pid)
    return pids


def cpu_seconds(pids: list[int], with_children: bool = False) -> tuple[float, float]:
    """CPU-seconds `pids` used so far: (user plus system, system alone)."""
    total = system = 0.0
    for pid in pids:
        try:
            procs = [psutil.Process(pid)]
            if with_children:
                procs += procs[0].children(recursive=True)
            for proc in procs:
                times = proc.cpu_times()
                total += times.user + times.system
                system += times.system
        except psutil.Error:
            continue
    return total, system


def run_step(topology: Topology, qps: float, step_s: float, traffic: str, workers: int) -> dict:
    config = LoadConfig(
        url=topology.gateway_url,
        qps=qps,
        duration_s=step_s,
        workers=workers,
        tokens_file=topology.tokens_file,
        drain_s=3.0,
        traffic=TrafficSpec(model=topology.model, **TRAFFIC[traffic]),
    )
    pids = component_pids(topology)
    with LoadRun.start(config) as run:
        machine_before = psutil.cpu_times()
        before = {name: cpu_seconds(p) for name, p in pids.items()}
        load_pids = [run.process.pid]
        load_before, _ = cpu_seconds(load_pids, with_children=True)
        started = time.monotonic()
        # Sample while the step runs: the load process is gone once wait() returns.
        load_used = 0.0
        while time.monotonic() - started < step_s:
            time.sleep(0.5)
            load_used = max(load_used, cpu_seconds(load_pids, with_children=True)[0] - load_before)
        elapsed = time.monotonic() - started
        after = {name: cpu_seconds(p) for name, p in pids.items()}
        cores = {name: (after[name][0] - before[name][0]) / elapsed for name in pids}
        kernel_cores = {name: (after[name][1] - before[name][1]) / elapsed for name in pids}
        cores["load"] = load_used / elapsed
        machine_after = psutil.cpu_times()
        # softirq work (much of loopback TCP) is in a process's system time when it ran in
        # that process's time slice, and in the machine's softirq time either way
        machine = {
            field: (getattr(machine_after, field) - getattr(machine_before, field)) / elapsed
            for field in ("user", "system", "softirq", "idle")
        }
        summary = run.wait(timeout_s=60)
    answered = summary.ok + sum(summary.failed.values())
    errors = (sum(summary.failed.values()) + summary.dropped) / max(1, summary.scheduled)
    return {
        "qps": qps,
        "achieved_qps": summary.achieved_qps,
        "answered": answered,
        "p99_ms": summary.latency_ms.get("p99"),
        "error_rate": errors,
        "failed": summary.failed,
        "dropped": summary.dropped,
        "cores": cores,
        "kernel_cores": kernel_cores,
        "machine": machine,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qps", default="250,500,1000,1250,1500", help="comma-separated steps")
    parser.add_argument("--step-s", type=float, default=15.0)
    parser.add_argument("--traffic", choices=sorted(TRAFFIC), default="short")
    parser.add_argument("--load-workers", type=int, default=1)
    parser.add_argument(
        "--active-gateways",
        type=int,
        default=1,
        help="gateways HAProxy spreads requests over, besides the backup (a fleet for N QPS "
        "has ceil(N / 1000) + 1)",
    )
    parser.add_argument(
        "--fleet-for",
        type=float,
        default=None,
        metavar="QPS",
        help="lay the stack out for this rate of the field traffic (replaces --active-gateways)",
    )
    args = parser.parse_args()
    steps = [float(q) for q in args.qps.split(",")]

    config = StackConfig(port=0, active_gateways=args.active_gateways)
    if args.fleet_for:
        layout = plan_fleet(args.fleet_for, DEFAULT_TRAFFIC)
        print(layout.describe(), file=sys.stderr)
        config = layout.stack_config(config)
    topology = start_stack(config, progress=True)
    results = []
    try:
        for qps in steps:
            print(f"step {qps:.0f} QPS for {args.step_s:.0f} s ...", file=sys.stderr, flush=True)
            results.append(run_step(topology, qps, args.step_s, args.traffic, args.load_workers))
    finally:
        stop_stack(topology)

    names = sorted({n for r in results for n in r["cores"]}, key=_component_order)
    print(f"\nstack capacity, traffic={args.traffic}, {args.step_s:.0f} s per step, 2-core machine")
    header = f"{'target':>7} {'achieved':>9} {'p99 ms':>8} {'errors':>7}  " + " ".join(
        f"{n[:9]:>9}" for n in names
    )
    print(header)
    for r in results:
        p99 = f"{r['p99_ms']:.0f}" if r["p99_ms"] is not None else "-"
        cores = " ".join(f"{r['cores'].get(n, 0.0):9.2f}" for n in names)
        print(f"{r['qps']:7.0f} {r['achieved_qps']:9.1f} {p99:>8} {r['error_rate']:7.2%}  {cores}")
        kernel = " ".join(
            f"{r['kernel_cores'][n]:9.2f}" if n in r["kernel_cores"] else f"{'-':>9}" for n in names
        )
        print(f"{'kernel':>7} {'':>9} {'':>8} {'':>7}  {kernel}")
        machine = ", ".join(f"{field} {used:.2f}" for field, used in r["machine"].items())
        print(f"{'':>7} whole machine: {machine}")
    print(
        "(CPU columns in cores; failures by class: "
        + "; ".join(f"{r['qps']:.0f}: {dict(r['failed'])} dropped {r['dropped']}" for r in results)
        + ")"
    )
    ok = [r for r in results if _sustained(r)]
    best = max((r["achieved_qps"] for r in ok), default=None)
    if best is None:
        print("no step sustained P99 < 2 s with < 1% errors")
        return 1
    print(f"sustained: {best:.0f} QPS with P99 < {P99_LIMIT_MS:.0f} ms and < 1% errors")
    return 0


def _sustained(result: dict) -> bool:
    p99 = result["p99_ms"]
    return p99 is not None and p99 < P99_LIMIT_MS and result["error_rate"] < ERROR_LIMIT


def _component_order(name: str) -> tuple[int, str]:
    order = defaultdict(lambda: 9, {"load": 0, "haproxy": 1, "redis": 8, "agents": 9})
    if name.startswith("gateway"):
        return (2, name)
    if name.startswith(("gpu", "cpu")):
        return (3, name)
    return (order[name], name)


if __name__ == "__main__":
    sys.exit(main())
