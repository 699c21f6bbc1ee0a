"""The gateway process: `python -m llmchaos.stack.gateway --settings PATH`.

Exit codes: 0 after SIGTERM/SIGINT, 2 for unreadable or invalid settings, 1 when the gateway
cannot start (token table unreadable, port taken).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

import uvloop

from llmchaos.errors import InvalidInput, StackError
from llmchaos.stack.gateway.server import Gateway
from llmchaos.stack.procs import settle_heap
from llmchaos.stack.settings import GatewaySettings, load_settings

log = logging.getLogger("llmchaos.stack.gateway")

_STOP_DEADLINE_S = 0.8
"""Longest a stop may take before the process exits anyway (HAProxy and the stack expect a
killed gateway to go away within about a second)."""


async def _serve(settings: GatewaySettings) -> None:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    gateway = Gateway(settings)
    await gateway.start()
    settle_heap()
    log.info(
        "gateway %s listening on %s:%d with %d worker(s)",
        settings.name,
        settings.host,
        gateway.port,
        len(settings.workers),
    )
    await stopping.wait()
    try:
        async with asyncio.timeout(_STOP_DEADLINE_S):
            await gateway.stop()
    except TimeoutError:
        log.warning("gateway %s: stop took over %.1f s, exiting", settings.name, _STOP_DEADLINE_S)
    log.info("gateway %s stopped", settings.name)


def main(argv: list[str] | None = None) -> int:
    """Run a gateway until SIGTERM/SIGINT; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m llmchaos.stack.gateway")
    parser.add_argument("--settings", required=True, type=Path, help="GatewaySettings JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = load_settings(GatewaySettings, args.settings)
    except InvalidInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        uvloop.run(_serve(settings))
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
