"""Pre-flight: the hosts file against this machine, before anything is started or changed.

One line per problem, naming the file, the field, the value and what would be right: a pid
that runs no process, a pid file that cannot be read, a port that something else already
holds for a process llmchaos would start, an executable that is not installed, a network
namespace or an environment variable that does not exist.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from llmchaos.errors import InvalidInput
from llmchaos.processes import pid_alive
from llmchaos.targets.hosts import firewall
from llmchaos.targets.hosts.procs import listeners, process_name, read_pid_file
from llmchaos.targets.hosts.topology import HostsTopology, Part

__all__ = ["INSTALL_HINTS", "preflight_problems"]

INSTALL_HINTS = {
    "litellm": "make setup installs LiteLLM into .venv-litellm (scripts/install-litellm.sh)",
    "nginx": "apt-get install nginx (make setup does it as root)",
    "redis-server": "apt-get install redis-server",
}
"""How to get the executables the examples use."""


def _section(part: Part) -> str:
    return "redis" if part.role == "redis" else f"{part.role}s.{part.name}"


def _executable_problem(part: Part, topology: HostsTopology) -> str | None:
    program = part.command[0].format(
        python=sys.executable,
        dir=str(topology.path.resolve().parent),
        state="",
        port=str(part.port),
        name=part.name,
    )
    found = shutil.which(program) if "/" not in program else program
    if found and os.access(found, os.X_OK) and Path(found).is_file():
        return None
    hint = INSTALL_HINTS.get(Path(program).name)
    return f"{_section(part)}.command: executable {program!r} not found" + (
        f"; {hint}" if hint else "; install it or correct the path"
    )


def _port_holder(part: Part) -> str | None:
    """Who already listens on the port of a process llmchaos would start (None: free)."""
    if part.netns:
        argv = ["ip", "netns", "exec", part.netns, "ss", "-Hltn", f"sport = :{part.port}"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
        return f"a process in netns {part.netns}" if out.strip() else None
    holders = listeners(part.port)
    if not holders:
        return None
    return ", ".join(f"pid {pid} ({process_name(pid)})" for pid in holders[:3])


def _pid_problem(part: Part) -> str | None:
    where = _section(part)
    if part.pid_file:
        try:
            pid = read_pid_file(part.pid_file)
        except InvalidInput as exc:
            return f"{where}.pid_file: {exc}; start the server, or give pid or command instead"
        field = "pid_file"
    elif part.pid is not None:
        pid, field = part.pid, "pid"
    else:
        return None
    if not pid_alive(pid):
        return (
            f"{where}.{field}: no process {pid} is running; start it and give its current pid, "
            "or give a command llmchaos starts"
        )
    return None


def preflight_problems(topology: HostsTopology, environ: Mapping[str, str]) -> list[str]:
    """Every problem of `topology` on this machine (empty: it can be opened)."""
    problems: list[str] = []
    namespaces: list[str] | None = None
    for part in topology.parts:
        where = _section(part)
        if part.netns:
            namespaces = firewall.namespaces() if namespaces is None else namespaces
            if part.netns not in namespaces:
                problems.append(
                    f"{where}.netns: no network namespace {part.netns!r} (ip netns list has "
                    f"{', '.join(namespaces) or 'none'})"
                )
                continue
        if not part.started_by_us:
            problem = _pid_problem(part)
            if problem:
                problems.append(problem)
            continue
        problem = _executable_problem(part, topology)
        if problem:
            problems.append(problem)
        holder = _port_holder(part)
        if holder:
            problems.append(
                f"{where}.url: port {part.port} is already in use by {holder}; stop it, or give "
                f"{part.name} a free port"
            )
    if topology.token == "env" and not environ.get(topology.token_env or ""):
        problems.append(
            f"front_door.token: environment variable {topology.token_env} is not set (it holds "
            "the token clients send)"
        )
    redis = topology.redis
    if redis and redis.password_env and not environ.get(redis.password_env):
        problems.append(f"redis.password_env: environment variable {redis.password_env} is not set")
    return [f"{topology.path}: {p}" for p in problems]
