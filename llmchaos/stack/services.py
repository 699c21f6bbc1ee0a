"""The stack's third-party servers: Redis (token cache) and HAProxy (front door).

Both are the real Debian binaries, run in the foreground under the stack's marker, with every
file they write inside the stack's state folder.
"""

from __future__ import annotations

import resource
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from llmchaos.errors import InvalidInput
from llmchaos.processes import Owner
from llmchaos.stack.procs import spawn

__all__ = [
    "HAPROXY_HTTP_REQUEST_TIMEOUT_S",
    "HAPROXY_MAX_CONNECTIONS",
    "STACK_OPEN_FILES",
    "HaproxyServer",
    "haproxy_config",
    "haproxy_server_states",
    "require_binary",
    "start_haproxy",
    "start_redis",
]

HAPROXY_HTTP_REQUEST_TIMEOUT_S = 5
"""Longest a client may take to send a whole request (headers and body): HAProxy's own
anti-DoS example uses 5 s; a real client sends a few KiB at once."""

_INSTALL_HINT = {
    "redis-server": "apt-get install redis-server",
    "haproxy": "apt-get install haproxy",
}


def require_binary(name: str) -> str:
    """Path of executable `name`; raises InvalidInput saying how to install it."""
    path = shutil.which(name)
    if path is None:
        hint = _INSTALL_HINT.get(name, f"install {name}")
        raise InvalidInput(f"{name} not found on PATH ({hint}, or run `make setup`)")
    return path


def start_redis(
    state_dir: Path, port: int, stack_id: str, owner: Owner, password: str
) -> subprocess.Popen[bytes]:
    """redis-server on 127.0.0.1:`port` without persistence (a cache, like the seed's), which
    requires `password` (given on its standard input: never on its command line or on disk)."""
    data_dir = state_dir / "redis"
    data_dir.mkdir(exist_ok=True)
    argv = [
        require_binary("redis-server"),
        "-",  # the rest of the configuration from stdin
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(data_dir),
        "--daemonize", "no",
    ]  # fmt: skip
    return spawn(
        argv,
        stack_id=stack_id,
        owner=owner,
        log_path=state_dir / "logs" / "redis.log",
        stdin_text=f"requirepass {password}\n",
    )


@dataclass(frozen=True)
class HaproxyServer:
    """A gateway as an HAProxy server line."""

    name: str
    address: str
    backup: bool


def haproxy_config(port: int, servers: list[HaproxyServer], stats_port: int) -> str:
    """HAProxy config: one front on 127.0.0.1:`port`, gateways checked every second.

    Requests go to the active (non-backup) gateways, the one with the fewest open
    connections first (LLM requests last seconds: round robin would pile them up on one); a
    backup server gets requests only when every active one is down.

    `fall 3 rise 2` (checks every 1 s, 0.5 s once one failed) marks a dead primary down in
    ~2 s, then the backup serves; a refused connection is retried and redispatched so that,
    until then, the retries land on another gateway. Three failures, not two: a busy gateway
    whose loop lagged past the 1 s check timeout twice (a token-cache stampede, a long-prompt
    surge at 1,000 QPS) was marked down, its load went to the others, and they fell in turn.
    The admin socket is TCP on loopback: a unix socket's path in a deep state folder can pass
    HAProxy's 97-character limit.

    Streaming: `option http-no-delay` sends each chunk at once. Without it HAProxy sends with
    MSG_MORE (like TCP_CORK) while it expects more of a chunked body, and the kernel held the
    start of every SSE answer ~130-200 ms (measured: first token 214 ms through HAProxy, 80 ms
    from the gateway).
    Slow clients (slowloris): a request's headers and body must arrive within
    `timeout http-request` (the body too, with `option http-buffer-request`; our bodies are a
    few KiB), an idle keep-alive connection is closed after `timeout http-keep-alive`, and a
    client that stops reading a stream after `timeout client`.
    """
    lines = [
        "global",
        f"    maxconn {_haproxy_maxconn()}",
        f"    stats socket ipv4@127.0.0.1:{stats_port} level admin",
        "defaults",
        "    mode http",
        "    option http-no-delay",
        "    option http-buffer-request",
        "    timeout connect 1s",
        f"    timeout http-request {HAPROXY_HTTP_REQUEST_TIMEOUT_S}s",
        "    timeout client 30s",
        "    timeout client-fin 5s",
        "    timeout server 30s",
        "    timeout server-fin 5s",
        "    timeout queue 5s",
        "    timeout http-keep-alive 30s",
        "    retries 2",
        "    option redispatch",
        "frontend api",
        f"    bind 127.0.0.1:{port}",
        "    default_backend gateways",
        "backend gateways",
        "    balance leastconn",
        "    option httpchk GET /healthz",
        "    http-check expect status 200",
        "    default-server inter 1s fastinter 500ms downinter 1s fall 3 rise 2",
    ]
    for server in servers:
        backup = " backup" if server.backup else ""
        lines.append(f"    server {server.name} {server.address} check{backup}")
    return "\n".join(lines) + "\n"


HAPROXY_MAX_CONNECTIONS = 20_000
"""HAProxy's maxconn where the open-file limit allows it (two descriptors per connection)."""
STACK_OPEN_FILES = 2 * HAPROXY_MAX_CONNECTIONS + 100
"""The soft open-file limit start_stack asks for before it starts anything: every process of
the stack inherits it (a 1,024 default allowed HAProxy 462 connections, and a gateway about
as many, against a load that holds ~10,000 at 1,200 QPS)."""


def _haproxy_maxconn() -> int:
    # HAProxy refuses to start with a maxconn above what the fd limit allows
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return HAPROXY_MAX_CONNECTIONS
    return max(256, min(HAPROXY_MAX_CONNECTIONS, (soft - 100) // 2))


def start_haproxy(
    config_path: Path, state_dir: Path, stack_id: str, owner: Owner
) -> subprocess.Popen[bytes]:
    """HAProxy in the foreground (`-db`) with `config_path`; raises InvalidInput on a bad one."""
    binary = require_binary("haproxy")
    check = subprocess.run(
        [binary, "-c", "-f", str(config_path)], capture_output=True, text=True, timeout=30
    )
    if check.returncode != 0:
        alerts = [line for line in check.stderr.splitlines() if "ALERT" in line]
        raise InvalidInput(f"{config_path}: haproxy rejects it: {' | '.join(alerts[:2])}")
    return spawn(
        [binary, "-db", "-f", str(config_path)],
        stack_id=stack_id,
        owner=owner,
        log_path=state_dir / "logs" / "haproxy.log",
    )


def haproxy_server_states(stats_port: int, timeout_s: float = 1.0) -> dict[str, str]:
    """Server name -> HAProxy status (UP, DOWN, MAINT ...) of the gateways backend; empty when
    the admin socket does not answer."""
    try:
        with socket.create_connection(("127.0.0.1", stats_port), timeout=timeout_s) as sock:
            sock.sendall(b"show stat\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    except OSError:
        return {}
    states: dict[str, str] = {}
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        fields = line.split(",")
        if (
            len(fields) > 17
            and fields[0] == "gateways"
            and fields[1] not in ("BACKEND", "FRONTEND")
        ):
            states[fields[1]] = fields[17]
    return states
