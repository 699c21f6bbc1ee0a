"""The embedded stack's HAProxy (its own config, `services.haproxy_config`) in front of any test
server, so that a test can measure what the front door does to answers."""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmchaos.processes import Owner
from llmchaos.stack.procs import free_port, stop_pids
from llmchaos.stack.services import HaproxyServer, haproxy_config, start_haproxy


@contextlib.contextmanager
def haproxy_in_front(backend_port: int, state_dir: Path) -> Iterator[str]:
    """HAProxy on a free port, one gateway server at 127.0.0.1:`backend_port` (checked with
    GET /healthz); yields its URL once a request through it is answered. Always stopped."""
    port = free_port()
    config = haproxy_config(
        port, [HaproxyServer("gateway-primary", f"127.0.0.1:{backend_port}", False)], free_port()
    )
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "haproxy.cfg"
    path.write_text(config)
    # owned by this test process: a cleanup removes it only once the test run is gone
    owner = Owner.this_process("run")
    process = start_haproxy(path, state_dir, stack_id=f"test-haproxy-{port}", owner=owner)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10.0
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=1.0) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                log = (state_dir / "logs" / "haproxy.log").read_text(errors="replace")
                pytest.fail(f"HAProxy in front of port {backend_port} did not serve: {log[-500:]}")
            time.sleep(0.1)
        yield url
    finally:
        stop_pids([process.pid])
        process.wait(timeout=5)
