"""Test targets for the load: the fake OpenAI server (or the scripted reference server) as a
child process, always stopped."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


class FakeServer:
    def __init__(self, process: subprocess.Popen[bytes], host: str, port: int):
        self.process = process
        self.url = f"http://{host}:{port}"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)


@pytest.fixture
def fake_server(tmp_path: Path) -> Iterator[Callable[..., FakeServer]]:
    started: list[FakeServer] = []

    def start(
        *args: str, module: str = "tests.load.fake_server", host: str = "127.0.0.1"
    ) -> FakeServer:
        """The server on `host` (fake_server only; the scripted one listens on 127.0.0.1)."""
        port_file = tmp_path / f"port{len(started)}"
        argv = [sys.executable, "-m", module, "--port-file", str(port_file), *args]
        if host != "127.0.0.1":
            argv += ["--host", host]
        process = subprocess.Popen(argv, cwd=REPO)
        deadline = time.monotonic() + 15
        while not port_file.exists():
            assert process.poll() is None and time.monotonic() < deadline, (
                "fake server did not start"
            )
            time.sleep(0.05)
        server = FakeServer(process, host, int(port_file.read_text()))
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            if server.process.poll() is None:
                server.kill()
