"""Open-loop load at 5000 QPS against a static nginx, and CPU per request vs stock Locust.

    .venv/bin/python bench/load_open_loop.py [--qps 5000] [--duration-s 60] [--workers 2]
                                             [--stock-s 30] [--stock-users 64]

Starts nginx on 127.0.0.1 (config in a temp folder) answering every POST
/v1/chat/completions with one fixed completion JSON, then
1. runs `LoadRun` (this package's open-loop user, Locust master + N workers) at --qps for
   --duration-s: achieved QPS vs target, schedule lag p99, dropped, failures;
2. runs stock Locust FastHttpUser closed-loop (--processes N) with the same request body for
   --stock-s twice: --stock-users without waits (its best case), and qps/10 users at 10/s
   each (the same request rate as the open loop);
and prints requests per load-CPU-second of both (CPU of every load process from psutil, master
included), side by side. nginx is stopped at the end whatever happens. Not a test.
"""

from __future__ import annotations

import argparse
import csv
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from _common import free_port

from llmchaos.load import LoadConfig, LoadRun
from llmchaos.load.traffic import TrafficSpec

ANSWER = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "model": "llmchaos-7b",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 600, "completion_tokens": 1, "total_tokens": 601},
    }
)
NGINX_CONF = """
daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    client_body_buffer_size 64k;
    keepalive_requests 1000000;
    server {{
        listen {host}:{port} backlog=8192;
        location /v1/chat/completions {{
            default_type application/json;
            add_header X-Serving-Mode gpu always;
            return 200 '{answer}';
        }}
        location / {{ return 200 'ok'; }}
    }}
}}
"""


class CpuMeter:
    """User+system CPU seconds of a process tree, sampled until stopped."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            for p in procs:
                try:
                    t = p.cpu_times()
                    self.cpu[p.pid] = t.user + t.system
                except psutil.Error:
                    pass
            self._stop.wait(0.25)

    def total(self) -> float:
        """CPU seconds so far (as of the last sample, at most 0.25 s old)."""
        return sum(self.cpu.values())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.total()


def start_nginx(tmp: Path, host: str = "127.0.0.1") -> tuple[subprocess.Popen[bytes], str]:
    """nginx answering the fixed completion on `host` (an address of this machine)."""
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, host=host, port=port, answer=ANSWER))
    proc = subprocess.Popen(["nginx", "-p", str(tmp), "-c", str(conf)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return proc, f"http://{host}:{port}"
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"nginx failed: {proc.stderr.read().decode()}") from None
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("nginx did not listen")


def run_open_loop(url: str, args: argparse.Namespace, tmp: Path) -> dict:
    config = LoadConfig(
        url=url,
        qps=args.qps,
        duration_s=args.duration_s,
        workers=args.workers,
        profile=args.profile,
        run_dir=str(tmp / "open"),
        drain_s=3.0,
        traffic=TrafficSpec(stream_share=0.0),
    )
    run = LoadRun.start(config)
    meter = CpuMeter(run.process.pid)
    try:
        summary = run.wait()
    finally:
        cpu_s = meter.stop()
        run.close()
    done = summary.ok + sum(summary.failed.values())
    return {"summary": summary, "cpu_s": cpu_s, "requests": done}


def run_stock(url: str, args: argparse.Namespace, tmp: Path, user_class: str, users: int) -> dict:
    prefix = tmp / user_class
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(Path(__file__).with_name("load_stock_locustfile.py")),
        user_class,
        "--headless",
        "--processes",
        str(args.workers),
        "-u",
        str(users),
        "-r",
        str(users),
        "-t",
        f"{args.stock_s}s",
        "--host",
        url,
        "--csv",
        str(prefix),
        "--only-summary",
        "--loglevel",
        "WARNING",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    meter = CpuMeter(proc.pid)
    try:
        proc.wait(timeout=args.stock_s + 60)
    finally:
        cpu_s = meter.stop()
        if proc.poll() is None:
            proc.kill()
    with open(f"{prefix}_stats.csv") as f:
        row = next(r for r in csv.DictReader(f) if r["Name"] == "Aggregated")
    return {
        "requests": int(row["Request Count"]),
        "failures": int(row["Failure Count"]),
        "rps": float(row["Requests/s"]),
        "p99_ms": float(row["99%"]),
        "cpu_s": cpu_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qps", type=float, default=5000.0)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--profile", default="poisson")
    parser.add_argument("--stock-s", type=int, default=30)
    parser.add_argument("--stock-users", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmchaos-bench-") as name:
        tmp = Path(name)
        nginx, url = start_nginx(tmp)
        try:
            ours = run_open_loop(url, args, tmp)
            stock = run_stock(url, args, tmp, "StockChatUser", args.stock_users)
            paced = run_stock(url, args, tmp, "PacedChatUser", int(args.qps / 10))
        finally:
            nginx.terminate()
            nginx.wait(timeout=10)
    s = ours["summary"]
    ours_per_cpu = ours["requests"] / ours["cpu_s"]
    print(f"open loop, {args.profile} {args.qps:.0f} QPS x {args.duration_s:.0f} s, ", end="")
    print(f"{args.workers} workers:")
    print(f"  scheduled {s.scheduled}  ok {s.ok}  failed {sum(s.failed.values())}  ", end="")
    print(f"dropped {s.dropped}  in flight {s.in_flight}  accounting closed {s.accounting_closed}")
    print(f"  achieved {s.achieved_qps:.1f} QPS = {100 * s.achieved_qps / args.qps:.2f}% of target")
    print(f"  schedule lag p99 {s.schedule_lag_p99_ms} ms   latency {s.latency_ms}")
    rows = [("open loop (this user)", ours["requests"], ours["cpu_s"], s.achieved_qps)]
    for name, r in (
        (f"stock, {args.stock_users} users no wait", stock),
        (f"stock, {int(args.qps / 10)} users x 10/s", paced),
    ):
        print(
            f"{name}, {args.workers} processes, {args.stock_s} s: {r['requests']} requests "
            f"({r['rps']:.0f} req/s), {r['failures']} failures, p99 {r['p99_ms']} ms"
        )
        rows.append((name, r["requests"], r["cpu_s"], r["rps"]))
    print("requests per load-CPU-second (master + workers), ratio = open loop / row:")
    for name, n, cpu_s, rps in rows:
        per_cpu = n / cpu_s
        print(
            f"  {name:34s} {per_cpu:8.0f}/CPU-s at {rps:7.0f} req/s  "
            f"({n} req / {cpu_s:.1f} CPU-s)  ratio {ours_per_cpu / per_cpu:.2f}x"
        )
    print("  goal: ratio >= 1.5x")


if __name__ == "__main__":
    main()
