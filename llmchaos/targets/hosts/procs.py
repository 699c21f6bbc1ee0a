"""Processes of the hosts target, seen through /proc: who listens on a port, a process and
its descendants, a process group; started marked, killed and waited for.

Why not only pids: nginx's master dies on SIGKILL but its workers keep serving and keep the
port (measured, nginx 1.22), and a restarted gateway gets a new pid. What answers on a port is
found from /proc/net/tcp (the listening socket's inode) and the processes holding that
socket, so a gateway crash kills every process that serves its port, whoever started it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from llmchaos.errors import InvalidInput
from llmchaos.processes import group_members, pid_alive, start_ticks, stat_fields
from llmchaos.signals import deferred

__all__ = [
    "HOSTS_ENV",
    "OWNER_ENV",
    "descendants",
    "group_members",
    "kill_all",
    "launch",
    "listeners",
    "process_name",
    "read_pid_file",
    "wait_gone",
]

HOSTS_ENV = "LLMCHAOS_HOSTS"
"""Environment marker of every process the hosts target starts: its target id."""
OWNER_ENV = "LLMCHAOS_HOSTS_OWNER"
"""Whom that target belongs to (`Owner.to_marker`)."""

_LISTEN = "0A"


def _listening_inodes(port: int, proc_net: Path) -> set[str]:
    inodes = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc_net / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if (
                len(fields) > 9
                and fields[3] == _LISTEN
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                inodes.add(fields[9])
    return inodes


def listeners(port: int, netns_pid: int | None = None) -> list[int]:
    """Pids holding a socket that listens on TCP `port` (any address), in this network
    namespace or in that of process `netns_pid`."""
    proc_net = Path(f"/proc/{netns_pid}/net") if netns_pid else Path("/proc/net")
    inodes = _listening_inodes(port, proc_net)
    if not inodes:
        return []
    wanted = {f"socket:[{inode}]" for inode in inodes}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(fd) in wanted:
                    found.append(int(entry.name))
                    break
    return sorted(found)


def _all_pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def descendants(pids: Iterable[int]) -> list[int]:
    """`pids` and every process below them."""
    parents: dict[int, list[int]] = {}
    for pid in _all_pids():
        fields = stat_fields(pid)
        if fields:
            parents.setdefault(int(fields[1]), []).append(pid)
    result: list[int] = []
    todo = [p for p in pids if pid_alive(p)]
    while todo:
        pid = todo.pop()
        if pid not in result:
            result.append(pid)
            todo.extend(parents.get(pid, []))
    return result


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def read_pid_file(path: str) -> int:
    """The pid in `path`; InvalidInput naming the file when it is missing or holds none."""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise InvalidInput(f"cannot read pid file {path}: {exc.strerror}") from None
    if not text.isdigit() or int(text) <= 0:
        raise InvalidInput(f"pid file {path} holds {text[:20]!r}, not a process id")
    return int(text)


def kill_all(pids: Sequence[int], sig: int = signal.SIGKILL) -> list[int]:
    """Send `sig` to each of `pids` that lives; returns those it was sent to."""
    sent = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            sent.append(pid)
    return sent


def wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """Wait until none of `pids` lives (zombies count as gone); returns those still alive."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while True:
        for pid in alive:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        alive = [pid for pid in alive if pid_alive(pid)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def launch(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    marks: Mapping[str, str],
    log_path: Path,
    netns: str | None = None,
) -> tuple[subprocess.Popen[bytes], int | None]:
    """Start `argv` in a session and process group of its own (a Ctrl-C in the run's
    terminal must not reach it; a cleanup finds and kills the whole group), output appended
    to `log_path`, inside `netns` when given. Returns the process and its start time (ticks).
    Signals wait until it is started, so an interrupted start leaves nothing unrecorded.
    Raises InvalidInput when the executable is not found."""
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log, deferred():
        try:
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env, **marks},
                start_new_session=True,
            )
        except (FileNotFoundError, PermissionError) as exc:
            raise InvalidInput(f"cannot start {argv[0]!r}: {exc.strerror}") from None
        return process, start_ticks(process.pid)
