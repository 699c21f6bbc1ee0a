"""How many short requests one gateway process proxies, and its CPU cost per request.

    .venv/bin/python bench/gateway_throughput.py [--duration-s 5] [--concurrency 64]
                                                 [--prompt-tokens 3] [--against 5cb083b]

Starts a throwaway redis-server, a SQLite token table, a trivial upstream worker (a fixed
JSON answer, no engine) and one gateway on 127.0.0.1, then drives the gateway closed-loop
with aiohttp for a bounded time (and the upstream directly, as the baseline). Prints req/s,
latency percentiles and CPU-seconds per 1000 requests of the gateway and the upstream (from
/proc, so Linux only). Everything shares this machine's cores, so req/s is a floor; the CPU
cost per request is the figure that carries over. `--against REV` also starts a gateway from
the `llmchaos` of git revision REV (same Redis, token table and upstream) and drives the two at
once, `--rounds` times, then prints both totals and their ratio: on a shared machine (and 2
hyperthreads) the CPU cost per request moves by +-30% with what else runs, so only gateways
measured side by side over the same seconds compare. Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from _common import cpu_s as process_cpu_s
from _common import free_port, tree_at, wait_http_ok

from llmchaos.stack.settings import GatewaySettings, UpstreamWorker, write_settings

_TOKENS = [f"sk-bench-{i:03d}" for i in range(100)]


def _body(prompt_tokens: int) -> bytes:
    """A chat request whose user message has `prompt_tokens` words (3: "one two three")."""
    content = "one two three" if prompt_tokens == 3 else " ".join(["word"] * prompt_tokens)
    return json.dumps(
        {"model": "llmchaos-7b", "messages": [{"role": "user", "content": content}]}
    ).encode()


_ANSWER = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1,
        "model": "llmchaos-7b",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
).encode()


def _serve_upstream(port: int) -> None:
    """The trivial upstream: /healthz ready, every completion the same fixed answer."""
    import uvloop
    from aiohttp import web

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready", "max_num_seqs": 100_000})

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=_ANSWER, content_type="application/json")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/v1/chat/completions", chat)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


async def _drive(url: str, concurrency: int, duration_s: float, body: bytes) -> list[float]:
    latencies_s: list[float] = []
    deadline = time.monotonic() + duration_s
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def user(i: int) -> None:
            headers = {
                "Content-Type": "application/json",
                "Authorization": f"Bearer {_TOKENS[i % len(_TOKENS)]}",
            }
            while time.monotonic() < deadline:
                start = time.monotonic()
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{url} answered {resp.status}")
                latencies_s.append(time.monotonic() - start)

        await asyncio.gather(*(user(i) for i in range(concurrency)))
    return latencies_s


def _measure(
    url: str, pids: dict[str, int], concurrency: int, duration_s: float, body: bytes
) -> tuple[int, dict[str, float]]:
    """Print and return the requests completed and each process's CPU-seconds."""
    import uvloop

    cpu_before_s = {name: process_cpu_s(pid) for name, pid in pids.items()}
    wall_start = time.monotonic()
    latencies_s = sorted(uvloop.run(_drive(url, concurrency, duration_s, body)))
    wall_s = time.monotonic() - wall_start
    cpus_s = {name: process_cpu_s(pid) - cpu_before_s[name] for name, pid in pids.items()}
    n = len(latencies_s)
    if not n:
        print(f"  {url}: no request completed")
        return 0, cpus_s
    print(f"  {n} requests in {wall_s:.1f} s: {n / wall_s:.0f} req/s")
    print(
        f"  latency p50 {latencies_s[n // 2] * 1000:.1f} ms, "
        f"p99 {latencies_s[int(n * 0.99)] * 1000:.1f} ms"
    )
    for name, cpu_s in cpus_s.items():
        print(
            f"  {name} CPU: {cpu_s:.2f} s = {cpu_s / n * 1000:.3f} CPU-s per 1000 requests "
            f"({cpu_s / wall_s * 100:.0f}% of one core)"
        )
    return n, cpus_s


def _measure_together(
    urls: dict[str, str], pids: dict[str, int], concurrency: int, duration_s: float, body: bytes
) -> dict[str, tuple[int, float]]:
    """Drive every gateway at once, so that they share whatever else the machine runs; print
    and return each one's requests completed and CPU-seconds."""
    import uvloop

    async def drive_all() -> list[list[float]]:
        return await asyncio.gather(
            *(_drive(url, concurrency, duration_s, body) for url in urls.values())
        )

    cpu_before_s = {name: process_cpu_s(pid) for name, pid in pids.items()}
    wall_start = time.monotonic()
    latencies = dict(zip(urls, uvloop.run(drive_all()), strict=True))
    wall_s = time.monotonic() - wall_start
    results = {}
    for name, latencies_s in latencies.items():
        n = len(latencies_s)
        cpu_s = process_cpu_s(pids[name]) - cpu_before_s[name]
        print(
            f"  gateway of {name}: {n / wall_s:.0f} req/s, {cpu_s:.2f} CPU-s = "
            f"{cpu_s / max(n, 1) * 1000:.3f} CPU-s per 1000 requests"
        )
        results[name] = (n, cpu_s)
    return results


def _start_gateway(
    settings: GatewaySettings, tmp: str, env: dict[str, str] | None
) -> subprocess.Popen[bytes]:
    """A gateway process (from the `llmchaos` that `env` imports); waits for /healthz."""
    path = write_settings(settings, Path(tmp) / f"{settings.name}.json")
    gateway = subprocess.Popen(
        [sys.executable, "-m", "llmchaos.stack.gateway", "--settings", str(path)],
        stderr=subprocess.DEVNULL,
        env=env,
    )
    wait_http_ok(f"http://127.0.0.1:{settings.port}/healthz")
    return gateway


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=5.0, help="per run (max 8)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--no-baseline", action="store_true", help="skip the direct run")
    parser.add_argument(
        "--prompt-tokens", type=int, default=3, help="words in the request's message"
    )
    parser.add_argument(
        "--against", metavar="REV", help="also measure the gateway of this git revision"
    )
    parser.add_argument("--rounds", type=int, default=2, help="turns each with --against")
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        _serve_upstream(args.serve_upstream)
        return 0
    duration_s = min(args.duration_s, 8.0)
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            redis_port, upstream_port, gateway_port = free_port(), free_port(), free_port()
            procs.append(
                subprocess.Popen(
                    [
                        *("redis-server", "--port", str(redis_port), "--bind", "127.0.0.1"),
                        *("--save", "", "--appendonly", "no"),
                    ],
                    stdout=subprocess.DEVNULL,
                )
            )
            db_path = Path(tmp) / "tokens.sqlite"
            with sqlite3.connect(db_path) as db:
                db.execute(
                    "CREATE TABLE tokens (token TEXT PRIMARY KEY, tenant TEXT NOT NULL,"
                    " revoked INTEGER NOT NULL DEFAULT 0)"
                )
                db.executemany("INSERT INTO tokens VALUES (?, 'bench', 0)", [(t,) for t in _TOKENS])
            db.close()
            upstream = subprocess.Popen(
                [sys.executable, __file__, "--serve-upstream", str(upstream_port)]
            )
            procs.append(upstream)
            upstream_url = f"http://127.0.0.1:{upstream_port}"
            wait_http_ok(f"{upstream_url}/healthz")
            settings = GatewaySettings(
                name="gateway-bench",
                port=gateway_port,
                workers=(UpstreamWorker(name="gpu-0", url=upstream_url, mode="gpu"),),
                redis_url=f"redis://127.0.0.1:{redis_port}/0",
                token_db_path=str(db_path),
                queue_shed_threshold=1_000_000,
            )
            gateways = {"new": _start_gateway(settings, tmp, None)}
            procs.append(gateways["new"])
            if args.against:
                old = dataclasses.replace(settings, name="gateway-old", port=free_port())
                gateways[args.against] = _start_gateway(old, tmp, tree_at(args.against))
                procs.append(gateways[args.against])
            ports = {"new": settings.port, args.against: old.port} if args.against else {}
            print(f"closed loop, concurrency {args.concurrency}, {os.cpu_count()} cores shared")
            body = _body(args.prompt_tokens)
            if not args.no_baseline:
                print("upstream directly (baseline):")
                _measure(
                    f"{upstream_url}/v1/chat/completions",
                    {"upstream": upstream.pid},
                    args.concurrency,
                    duration_s,
                    body,
                )
            if not args.against:
                print("through the gateway:")
                _measure(
                    f"http://127.0.0.1:{gateway_port}/v1/chat/completions",
                    {"gateway": gateways["new"].pid, "upstream": upstream.pid},
                    args.concurrency,
                    duration_s,
                    body,
                )
                return 0
            totals = {name: [0, 0.0] for name in gateways}
            for round_ in range(1, args.rounds + 1):
                print(f"round {round_}, both gateways at once, {args.concurrency} in flight each:")
                for name, (n, cpu_s) in _measure_together(
                    {
                        name: f"http://127.0.0.1:{port}/v1/chat/completions"
                        for name, port in ports.items()
                    },
                    {name: proc.pid for name, proc in gateways.items()},
                    args.concurrency,
                    duration_s,
                    body,
                ).items():
                    totals[name][0] += n
                    totals[name][1] += cpu_s
            per_1000 = {name: cpu_s / max(n, 1) * 1000 for name, (n, cpu_s) in totals.items()}
            for name, figure in per_1000.items():
                print(f"gateway of {name}: {figure:.3f} CPU-s per 1000 requests (all rounds)")
            print(f"new / {args.against}: {per_1000['new'] / per_1000[args.against]:.2f}")
        finally:
            for proc in reversed(procs):
                _stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
