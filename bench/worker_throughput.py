"""How many short non-streaming requests one engine-worker process sustains, and its CPU cost.

    .venv/bin/python bench/worker_throughput.py [--duration-s 10] [--concurrency 256]
                                                [--against 5cb083b]

Starts one worker (GPU profile, load_s 0, max_num_seqs 1024 so the simulated batch is not the
limit) on 127.0.0.1, drives it closed-loop from client processes with aiohttp for a bounded
time, and prints requests/s, latency percentiles and the worker's CPU-seconds per 1000
requests (from /proc, so Linux only). `--against REV` also runs a worker from the `llmchaos`
of git revision REV, the two in turn, `--rounds` times each, and prints both figures and
their ratio: on a shared machine only figures from one run compare. `--floor` then also
runs the least a Python server can do per request on this box, under the same clients: a bare
uvloop + httptools server answering a fixed body after the worker's median latency; what the
worker costs above it is its API, engine and metrics. After the load, `--scrapes` GETs
/metrics on one connection (2,000 by default) and prints the worker's CPU per scrape: the
gateways' degradation polls, about 200 a second in the 1,000-QPS fleet. Not a test: it prints
figures. `--against` reads the older revision's settings without the fields it does not know
yet (left at their defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import http.client
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from _common import cpu_s, free_port, tree_at, wait_http_ok

from llmchaos.stack.settings import (
    GPU_PROFILE,
    EngineProfile,
    WorkerSettings,
    settings_to_dict,
    write_settings,
)
from llmchaos.stack.tokens import make_text


async def _drive(url: str, concurrency: int, duration_s: float, max_tokens: int) -> list[float]:
    body = json.dumps(
        {
            "model": "llmchaos-7b",
            "messages": [{"role": "user", "content": make_text(16)}],
            "max_tokens": max_tokens,
        }
    ).encode()
    headers = {"Content-Type": "application/json"}
    latencies_s: list[float] = []
    deadline = time.monotonic() + duration_s
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def user() -> None:
            while time.monotonic() < deadline:
                start = time.monotonic()
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"worker answered {resp.status}")
                latencies_s.append(time.monotonic() - start)

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return latencies_s


def _floor_server(port: int, delay_s: float) -> None:
    import httptools
    import uvloop

    body = json.dumps({"choices": [{"message": {"content": make_text(8)}}]}).encode()
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (
            len(body),
            body,
        )
    )

    class Bare(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_message_complete(self) -> None:
            asyncio.get_running_loop().call_later(delay_s, self.transport.write, answer)

    async def serve() -> None:
        await asyncio.get_running_loop().create_server(Bare, "127.0.0.1", port)
        await asyncio.Event().wait()

    uvloop.run(serve())


def _client(url: str, concurrency: int, duration_s: float, max_tokens: int, out: str) -> None:
    import uvloop

    latencies_s = uvloop.run(_drive(url, concurrency, duration_s, max_tokens))
    cpu_s = time.process_time()
    Path(out).write_text(json.dumps({"latencies_s": latencies_s, "cpu_s": cpu_s}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=10.0, help="load time (max 20)")
    parser.add_argument("--concurrency", type=int, default=256, help="requests in flight")
    parser.add_argument("--clients", type=int, default=1, help="client processes")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--cost-scale",
        type=float,
        default=1.0,
        help="multiply the GPU profile's step and API costs (below 1 finds the process's limit)",
    )
    parser.add_argument(
        "--against", metavar="REV", help="also measure the worker of this git revision"
    )
    parser.add_argument("--rounds", type=int, default=2, help="turns each with --against")
    parser.add_argument(
        "--floor", action="store_true", help="also measure a bare server (module docstring)"
    )
    parser.add_argument(
        "--scrapes",
        type=int,
        default=2000,
        help="GET /metrics this often after the load (0: not), the worker's CPU per scrape",
    )
    args = parser.parse_args()
    if args.floor and args.against:
        parser.error("--floor measures beside one worker's run: leave out --against")
    duration_s = min(args.duration_s, 20.0)

    scale = args.cost_scale
    profile = dataclasses.replace(
        GPU_PROFILE,
        load_s=0.0,
        max_num_seqs=1024,
        kv_cache_tokens=1_000_000,
        api_overhead_ms=GPU_PROFILE.api_overhead_ms * scale,
        prefill_base_ms=GPU_PROFILE.prefill_base_ms * scale,
        prefill_ms_per_token=GPU_PROFILE.prefill_ms_per_token * scale,
        decode_base_ms=GPU_PROFILE.decode_base_ms * scale,
        decode_ms_per_seq=GPU_PROFILE.decode_ms_per_seq * scale,
    )
    print(
        f"concurrency {args.concurrency}, 16 prompt tokens, max_tokens {args.max_tokens}, "
        f"cost scale {scale}"
    )
    if not args.against:
        n, worker_cpu_s, p50_s, _ = _run_worker(profile, None, args, duration_s)
        if args.floor:
            _print_floor(args, duration_s, p50_s, worker_cpu_s / max(n, 1) * 1000)
        return 0
    totals: dict[str, list[float]] = {args.against: [0, 0.0, 0.0], "new": [0, 0.0, 0.0]}
    envs = {args.against: tree_at(args.against), "new": None}
    for round_ in range(1, args.rounds + 1):
        for name, env in envs.items():
            print(f"round {round_}, the worker of {name}:")
            n, worker_cpu_s, _, scrape_us = _run_worker(profile, env, args, duration_s)
            totals[name][0] += n
            totals[name][1] += worker_cpu_s
            totals[name][2] += scrape_us / args.rounds
    per_1000 = {name: cpu_s / max(n, 1) * 1000 for name, (n, cpu_s, _) in totals.items()}
    for name, figure in per_1000.items():
        print(f"worker of {name}: {figure:.3f} CPU-s per 1000 requests (all rounds)")
    print(f"new / {args.against}: {per_1000['new'] / per_1000[args.against]:.2f}")
    if args.scrapes:
        old_us, new_us = totals[args.against][2], totals["new"][2]
        print(
            f"/metrics: {old_us:.0f} CPU-us a scrape for {args.against}, {new_us:.0f} new: "
            f"{new_us / old_us:.2f}"
        )
    return 0


def _print_floor(
    args: argparse.Namespace, duration_s: float, delay_s: float, worker: float
) -> None:
    port = free_port()
    server = multiprocessing.Process(target=_floor_server, args=(port, delay_s), daemon=True)
    server.start()
    try:
        assert server.pid is not None
        wait_http_ok(f"http://127.0.0.1:{port}/", timeout_s=15.0)
        cpu_before_s = cpu_s(server.pid)
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "client.json")
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            _client(url, args.concurrency, duration_s, args.max_tokens, out)
            n = len(json.loads(Path(out).read_text())["latencies_s"])
        floor = (cpu_s(server.pid) - cpu_before_s) / max(n, 1) * 1000
    finally:
        server.kill()
        server.join()
    print(
        f"bare server, answers after {delay_s * 1000:.0f} ms: {n} requests, {floor:.3f} CPU-s "
        f"per 1000 requests; the worker {worker:.3f}, {worker - floor:.3f} above the floor"
    )


_FIELDS_OF = """
import dataclasses, json
from llmchaos.stack.settings import EngineProfile, WorkerSettings
classes = (WorkerSettings, EngineProfile)
print(json.dumps([[f.name for f in dataclasses.fields(c)] for c in classes]))
"""


def _settings_for(settings: WorkerSettings, env: dict[str, str]) -> dict[str, object]:
    """The settings as the worker that `env` imports reads them: the fields its revision
    does not know are left out when at their defaults (a later stop added them); one that is
    not refuses the comparison."""
    known = subprocess.run(
        [sys.executable, "-c", _FIELDS_OF], env=env, check=True, capture_output=True, text=True
    ).stdout
    worker_fields, profile_fields = json.loads(known)
    data = settings_to_dict(settings)
    defaults = settings_to_dict(
        WorkerSettings(name="bench", port=settings.port, profile=GPU_PROFILE)
    )
    for fields, new, default in (
        (worker_fields, data, defaults),
        (profile_fields, data["profile"], defaults["profile"]),
    ):
        for name in set(new) - set(fields):
            if name not in default or new[name] != default[name]:
                raise SystemExit(f"the older worker has no setting {name}: cannot compare")
            del new[name]
    return data


def _run_worker(
    profile: EngineProfile, env: dict[str, str] | None, args: argparse.Namespace, duration_s: float
) -> tuple[int, float, float, float]:
    """One worker (from the `llmchaos` that `env` imports) under the closed-loop clients;
    prints and returns the requests completed, the worker's CPU-seconds, the median latency
    and its CPU-microseconds per /metrics scrape (after the load)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        settings = WorkerSettings(name="bench", port=port, profile=profile)
        settings_path = Path(tmp) / "worker.json"
        if env is None:
            write_settings(settings, settings_path)
        else:
            settings_path.write_text(json.dumps(_settings_for(settings, env)))
        worker = subprocess.Popen(
            [sys.executable, "-m", "llmchaos.stack.worker", "--settings", str(settings_path)],
            stderr=subprocess.DEVNULL,
            env=env,
        )
        try:
            wait_http_ok(f"http://127.0.0.1:{port}/healthz")
            cpu_before_s = cpu_s(worker.pid)
            wall_start = time.monotonic()
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            outs = [str(Path(tmp) / f"client-{i}.json") for i in range(args.clients)]
            per_client = max(1, args.concurrency // args.clients)
            procs = [
                multiprocessing.Process(
                    target=_client, args=(url, per_client, duration_s, args.max_tokens, out)
                )
                for out in outs
            ]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join(duration_s + 30.0)
                if proc.is_alive():
                    proc.kill()
            wall_s = time.monotonic() - wall_start
            worker_cpu_s = cpu_s(worker.pid) - cpu_before_s
            scrape_us = _scrape_cost_us(worker.pid, port, args.scrapes)
        finally:
            worker.terminate()
            try:
                worker.wait(5.0)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        results = [json.loads(Path(out).read_text()) for out in outs if Path(out).exists()]
    latencies_s = sorted(x for r in results for x in r["latencies_s"])
    n = len(latencies_s)
    if not n:
        print("  no request completed")
        return 0, worker_cpu_s, 0.0, scrape_us
    print(f"  {n} requests in {wall_s:.1f} s: {n / wall_s:.0f} req/s")
    print(
        f"  latency p50 {latencies_s[n // 2] * 1000:.0f} ms, "
        f"p99 {latencies_s[int(n * 0.99)] * 1000:.0f} ms"
    )
    print(
        f"  worker CPU: {worker_cpu_s:.2f} s = {worker_cpu_s / n * 1000:.3f} CPU-s per 1000 "
        f"requests ({worker_cpu_s / wall_s * 100:.0f}% of one core)"
    )
    print(f"  client CPU: {sum(r['cpu_s'] for r in results):.2f} s in {len(results)} process(es)")
    if args.scrapes:
        print(f"  /metrics: {scrape_us:.0f} worker CPU-us a scrape ({args.scrapes} scrapes)")
    return n, worker_cpu_s, latencies_s[n // 2], scrape_us


def _scrape_cost_us(pid: int, port: int, scrapes: int) -> float:
    """The worker's CPU-microseconds per GET /metrics, `scrapes` of them on one connection
    (what the gateways' degradation polls cost it: its histograms hold the load's requests)."""
    if not scrapes:
        return 0.0
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
    try:
        before_s = cpu_s(pid)
        for _ in range(scrapes):
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"/metrics answered {response.status}")
        return (cpu_s(pid) - before_s) / scrapes * 1e6
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
