"""A small OpenAI-compatible test target on 127.0.0.1, run as its own process.

    python -m tests.load.fake_server --port-file F [--delay-ms 5] [--stall-at-s 4 --stall-s 3]
                                     [--serial-ms 2]

Answers POST /v1/chat/completions (plain JSON, or SSE when "stream": true) with
`X-Serving-Mode: gpu`, and GET / with 200. A stall holds every request that arrives, or is
in progress, during [stall_at_s, stall_at_s + stall_s) after the server start until the stall
ends: what a hung GPU worker looks like to the client. --serial-ms serves one request at a
time for that long each: a target with a known capacity (1000 / serial_ms requests/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from aiohttp import web

COMPLETION = {
    "id": "chatcmpl-test",
    "object": "chat.completion",
    "model": "llmchaos-7b",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def build_app(
    delay_ms: float, stall_at_s: float | None, stall_s: float, serial_ms: float
) -> web.Application:
    t0 = time.monotonic()
    # A single "accelerator": with serial_ms > 0 each request takes the next free service slot
    # of serial_ms, so the server saturates at 1000 / serial_ms requests/s and queues beyond.
    # Slots follow the clock, not a lock held across a sleep: each such sleep overshoots by the
    # loop's wake-up delay, which made the capacity 290..370/s instead of 500/s depending on
    # how busy the machine was.
    next_free_s = 0.0

    async def hold_during_stall() -> None:
        if stall_at_s is None:
            return
        now = time.monotonic() - t0
        if stall_at_s <= now < stall_at_s + stall_s:
            await asyncio.sleep(stall_at_s + stall_s - now)

    async def chat(request: web.Request) -> web.StreamResponse:
        nonlocal next_free_s
        body = await request.json()
        await asyncio.sleep(delay_ms / 1000.0)
        await hold_during_stall()
        if serial_ms > 0:
            now_s = time.monotonic()
            next_free_s = max(now_s, next_free_s) + serial_ms / 1000.0
            await asyncio.sleep(next_free_s - now_s)
        headers = {"X-Serving-Mode": "gpu"}
        if not body.get("stream"):
            return web.json_response(COMPLETION, headers=headers)
        response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await response.prepare(request)
        n = min(int(body.get("max_tokens", 4)), 5)
        role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
        await response.write(f"data: {json.dumps(role)}\n\n".encode())
        for _ in range(n):
            await asyncio.sleep(0.002)
            chunk = {"choices": [{"index": 0, "delta": {"content": "tok "}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": n}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response

    async def root(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/", root)
    return app


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--stall-at-s", type=float, default=None)
    parser.add_argument("--stall-s", type=float, default=3.0)
    parser.add_argument("--serial-ms", type=float, default=0.0)
    parser.add_argument("--max-lifetime-s", type=float, default=120.0)
    args = parser.parse_args()
    runner = web.AppRunner(
        build_app(args.delay_ms, args.stall_at_s, args.stall_s, args.serial_ms), access_log=None
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    tmp = Path(args.port_file + ".tmp")
    tmp.write_text(str(port))
    tmp.rename(args.port_file)
    # Bounded: a test that forgets this server does not leave it running for long.
    await asyncio.sleep(args.max_lifetime_s)
    await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
