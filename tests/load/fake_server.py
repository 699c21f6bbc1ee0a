"""A small OpenAI-compatible test target on 127.0.0.1 (or --host), run as its own process.

    python -m tests.load.fake_server --port-file F [--host 127.0.0.1] [--delay-ms 5]
                                     [--stall-at-s 4 --stall-s 3]
                                     [--serial-ms 2] [--stall-from-first] [--key K]
                                     [--fail-every 503:10 ...] [--completion-tokens 1]

Answers POST /v1/chat/completions (plain JSON, or SSE when "stream": true) with
`X-Serving-Mode: gpu`, and GET / with 200. A stall holds every request that arrives, or is
in progress, during [stall_at_s, stall_at_s + stall_s) after the server start until the stall
ends: what a hung GPU worker looks like to the client. --serial-ms serves one request at a
time for that long each: a target with a known capacity (1000 / serial_ms requests/s).
--stall-from-first counts the stall from the first request instead (a load's time zero).
--key answers 401 to any other bearer token. --fail-every STATUS:N answers STATUS (an OpenAI
error body) to every Nth request, counting from the first (503:10 and 429:10 together fail
requests 10, 20, ... with 503 and 1, 11, ... with 429): a provider with known error rates.
Plain answers carry `usage.completion_tokens` = --completion-tokens.
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
    delay_ms: float,
    stall_at_s: float | None,
    stall_s: float,
    serial_ms: float,
    *,
    stall_from_first: bool = False,
    key: str | None = None,
    fail_every: tuple[tuple[int, int], ...] = (),
    completion_tokens: int = 1,
) -> web.Application:
    t0 = time.monotonic()
    seen = 0
    completion = {
        **COMPLETION,
        "usage": {"prompt_tokens": 1, "completion_tokens": completion_tokens, "total_tokens": 2},
    }
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

    def failure(n: int) -> int | None:
        """The status request number `n` (1-based) is failed with, if any."""
        for i, (status, every) in enumerate(fail_every):
            if n % every == i % every:
                return status
        return None

    async def chat(request: web.Request) -> web.StreamResponse:
        nonlocal next_free_s, seen, t0
        seen += 1
        if seen == 1 and stall_from_first:
            t0 = time.monotonic()
        if key is not None and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        status = failure(seen)
        if status is not None:
            return web.json_response({"error": {"code": str(status)}}, status=status)
        body = await request.json()
        await asyncio.sleep(delay_ms / 1000.0)
        await hold_during_stall()
        if serial_ms > 0:
            now_s = time.monotonic()
            next_free_s = max(now_s, next_free_s) + serial_ms / 1000.0
            await asyncio.sleep(next_free_s - now_s)
        headers = {"X-Serving-Mode": "gpu"}
        if not body.get("stream"):
            return web.json_response(completion, headers=headers)
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
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--stall-at-s", type=float, default=None)
    parser.add_argument("--stall-s", type=float, default=3.0)
    parser.add_argument("--serial-ms", type=float, default=0.0)
    parser.add_argument("--max-lifetime-s", type=float, default=120.0)
    parser.add_argument("--stall-from-first", action="store_true")
    parser.add_argument("--key", default=None)
    parser.add_argument("--fail-every", action="append", default=[], metavar="STATUS:N")
    parser.add_argument("--completion-tokens", type=int, default=1)
    args = parser.parse_args()
    fail_every = tuple(
        (int(status), int(every)) for status, every in (item.split(":") for item in args.fail_every)
    )
    app = build_app(
        args.delay_ms,
        args.stall_at_s,
        args.stall_s,
        args.serial_ms,
        stall_from_first=args.stall_from_first,
        key=args.key,
        fail_every=fail_every,
        completion_tokens=args.completion_tokens,
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, 0, backlog=4096)
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
