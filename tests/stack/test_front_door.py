"""The embedded stack's front door (HAProxy with the stack's own config): slow clients are cut
off, streams are not held back.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmchaos.load import LoadConfig, LoadRun
from llmchaos.load.traffic import TrafficSpec
from llmchaos.stack.services import HAPROXY_HTTP_REQUEST_TIMEOUT_S
from llmchaos.stack.topology import Topology
from tests.haproxy_front import haproxy_in_front

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[int]:
    """The scripted reference server (tests/load) as the gateway behind HAProxy."""
    port_file = tmp_path / "port"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "tests.load.scripted_server", "--port-file", str(port_file)),
            *("--ttft-ms", "10", "--itl-ms", "5", "--tokens", "4"),
        ],
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 15
        while not port_file.exists():
            assert process.poll() is None and time.monotonic() < deadline, "no backend"
            time.sleep(0.05)
        yield int(port_file.read_text())
    finally:
        process.kill()
        process.wait(timeout=5)


def open_slow_clients(port: int, count: int, first: bytes) -> list[socket.socket]:
    clients = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(first)
        sock.setblocking(False)
        clients.append(sock)
    return clients


@pytest.mark.parametrize(
    "first",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",  # headers never end
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{",
    ],
    ids=["slow-headers", "slow-body"],
)
def test_100_slowloris_connections_are_closed_and_others_still_served(
    backend: int, tmp_path: Path, first: bytes
) -> None:
    with haproxy_in_front(backend, tmp_path / "haproxy") as url:
        port = int(url.rsplit(":", 1)[1])
        clients = open_slow_clients(port, 100, first)
        selector = selectors.DefaultSelector()
        for sock in clients:
            selector.register(sock, selectors.EVENT_READ)
        started = time.monotonic()
        closed: dict[socket.socket, float] = {}
        try:
            deadline = started + HAPROXY_HTTP_REQUEST_TIMEOUT_S + 5.0
            next_trickle = started + 1.0
            served = False
            while len(closed) < len(clients) and time.monotonic() < deadline:
                for key, _ in selector.select(timeout=0.1):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        data = sock.recv(65536)
                    except (ConnectionResetError, BlockingIOError):
                        data = b""
                    if not data:  # closed (HAProxy may first send a 408)
                        closed[sock] = time.monotonic() - started
                        selector.unregister(sock)
                if time.monotonic() >= next_trickle:  # one more byte a second
                    for sock in clients:
                        if sock not in closed:
                            with contextlib.suppress(OSError):
                                sock.send(b"a" if first.endswith(b"{") else b"X-Slow: 1\r\n")
                    next_trickle += 1.0
                if not served:
                    with urllib.request.urlopen(f"{url}/healthz", timeout=3) as response:
                        served = response.status == 200
        finally:
            for sock in clients:
                sock.close()
            selector.close()
    assert served, "a normal request was not served while the slow clients held connections"
    assert len(closed) == len(clients), f"{len(clients) - len(closed)} still open"
    slowest_s = max(closed.values())
    assert HAPROXY_HTTP_REQUEST_TIMEOUT_S - 1 <= slowest_s <= HAPROXY_HTTP_REQUEST_TIMEOUT_S + 3


@pytest.fixture(scope="module")
def stack(module_stack_factory) -> Topology:  # type: ignore[no-untyped-def]
    return module_stack_factory()


def test_streams_are_not_held_back_by_the_front_door_or_the_gateway(
    stack: Topology, tmp_path: Path
) -> None:
    """TTFT through HAProxy within 15 ms of the gateway's own, and the gateway's and the
    worker's chunks leave one by one (ITL through every hop is the engine's step).

    The three loads run at once, so that they meet the same batches of the same engines
    (one after the other, the medians moved by a decode step between runs)."""
    primary = next(g for g in stack.gateways if g.role == "primary")
    urls = {
        "HAProxy": stack.gateway_url,
        "gateway": primary.url,
        "worker": stack.worker("gpu-0").url,
    }
    runs = {
        hop: LoadRun.start(
            LoadConfig(
                url=url,
                qps=10,
                duration_s=5,
                profile="constant",
                tokens_file=stack.tokens_file,
                seed=i,
                run_dir=str(tmp_path / hop),
                traffic=TrafficSpec(
                    stream_share=1.0, context_tokens=0, prompt_tokens="16", output_tokens="8"
                ),
            )
        )
        for i, (hop, url) in enumerate(urls.items())
    }
    summaries = {}
    for hop, run in runs.items():
        with run:
            summaries[hop] = run.wait()
    for hop, summary in summaries.items():
        assert summary.ok == summary.scheduled == 50, (hop, summary)
    ttft = {hop: float(s.ttft_ms["p50"] or 0) for hop, s in summaries.items()}
    itl = {hop: float(s.itl_ms["p50"] or 0) for hop, s in summaries.items()}
    # Buffering in HAProxy added ~130 ms; the medians of three simultaneous loads differ by
    # where their requests land in the batches (CI once saw 5.01 ms between two of them).
    assert abs(ttft["HAProxy"] - ttft["gateway"]) <= 15.0, ttft
    assert abs(itl["HAProxy"] - itl["worker"]) <= 2.0, itl
    assert abs(itl["gateway"] - itl["worker"]) <= 2.0, itl
    assert itl["worker"] >= 5.0, itl  # a decode step, not chunks arriving in one lump
