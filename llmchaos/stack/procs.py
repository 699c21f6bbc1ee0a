"""Processes of the stack: start them marked, wait for them, stop them, find them again.

Every process the stack starts carries the environment variable `LLMCHAOS_STACK=<stack id>`;
`stop_stack_processes` and `llmchaos cleanup` find what a crashed or killed run left behind by
it — also processes whose parent died and that went to init. redis-server overwrites its
environment block with its process title, so it is known instead by its working directory:
the `redis` folder inside a state folder named by the stack id.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmchaos.errors import ComponentNotReady, InvalidInput
from llmchaos.processes import Owner, pid_alive, stop_group, stop_pids
from llmchaos.signals import deferred

__all__ = [
    "OWNER_ENV",
    "STACK_ENV",
    "STACK_ID_PATTERN",
    "StackProcess",
    "find_stack_processes",
    "free_port",
    "http_get_status",
    "port_in_use",
    "scan_stack_processes",
    "set_parent_death_signal",
    "set_process_name",
    "settle_heap",
    "spawn",
    "stop_pids",
    "stop_stack_processes",
    "wait_until",
]

STACK_ENV = "LLMCHAOS_STACK"
"""Environment marker set on every process a stack starts; its value is the stack id."""
OWNER_ENV = "LLMCHAOS_STACK_OWNER"
"""Environment marker of whom the stack belongs to (`Owner.to_marker`), so a cleanup can tell a
live run's stack from a dead one's even without the stack's state folder."""

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something already listens on (or holds) `host:port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux prctl).

    Used in node agents' children, so a SIGKILLed agent takes its workers with it.
    """
    _prctl(_PR_SET_PDEATHSIG, sig)


def set_process_name(name: str) -> None:
    """Name this process `name` (its first 15 bytes) in ps's COMM column, top and pgrep: a
    process forked from another keeps its parent's command line."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def _prctl(option: int, arg: int | bytes) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


_GC_YOUNG_THRESHOLD = 10_000
"""Allocations between two collections of the young generation (CPython's default: 700). A
serving process allocates hundreds of short-lived objects per request; at 700 it collected
several times per request batch, and every tenth young collection also walked the middle one."""


def settle_heap() -> None:
    """Make the cyclic garbage collector cheap for a serving process; call it once the process
    has started (imports done, app built). The heap built so far is frozen, so that full
    collections no longer walk it, and young collections run less often. In a gateway under
    load the collector took 8% of the CPU (perf, 2026-12-04: gc_collect_main and its visitors);
    freezing alone left 5%, both together under 0.1%."""
    gc.collect()  # nothing collectable goes into the frozen generation
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def spawn(
    argv: Sequence[str],
    *,
    stack_id: str,
    owner: Owner,
    log_path: Path,
    env: dict[str, str] | None = None,
    stdin_text: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start `argv` in its own session, marked with the stack id and its owner, output
    appended to `log_path`; `stdin_text` is written to its standard input (how a secret
    reaches a process without its command line or a file).

    Own session: a Ctrl-C in the terminal that ran `stack up` must not reach the stack; the
    stack is stopped by `stack down`, the control's cleanup, or `llmchaos cleanup`. Signals
    are deferred until the child has exec'd with its marks, so an interrupted start never
    leaves a process that a cleanup cannot find. Raises InvalidInput when the executable does
    not exist.
    """
    full_env = {**os.environ, **(env or {}), STACK_ENV: stack_id, OWNER_ENV: owner.to_marker()}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    process: subprocess.Popen[bytes] | None = None
    try:
        with log_path.open("ab") as log, deferred():
            try:
                process = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL if stdin_text is None else subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=full_env,
                    start_new_session=True,
                )
            except FileNotFoundError as exc:
                raise InvalidInput(f"cannot start {argv[0]!r}: not found") from exc
            if process.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    process.stdin.write((stdin_text or "").encode())
                process.stdin.close()
    except BaseException:
        # a signal held while it started is raised as `deferred` ends: the caller never gets
        # the process, and the teardown's sweep can miss it (redis-server overwrites its
        # environment, marks included, before it moves into its folder)
        if process is not None:
            stop_group(process, grace_s=2.0)
        raise
    return process


STACK_ID_PATTERN = re.compile(r"\d{8}-\d{6}-[0-9a-f]{4}")
"""Shape of a stack id (and of its state folder's name): <date>-<time>-<4 hex>."""


@dataclass(frozen=True)
class StackProcess:
    """A live process that belongs to a stack."""

    pid: int
    stack_id: str
    owner: Owner | None
    """From its OWNER_ENV marker; None for redis-server, which overwrites its environment."""
    state_dir: Path | None
    """Known for redis-server (its working directory is `<state dir>/redis`)."""


def _stack_process(proc: Path) -> StackProcess | None:
    try:
        environ = (proc / "environ").read_bytes()
    except OSError:
        return None
    marks = {}
    for item in environ.split(b"\0"):
        key, _, value = item.partition(b"=")
        if key in (STACK_ENV.encode(), OWNER_ENV.encode()):
            marks[key.decode()] = value.decode(errors="replace")
    pid = int(proc.name)
    if STACK_ENV in marks:
        owner = Owner.from_marker(marks.get(OWNER_ENV, ""))
        return StackProcess(pid, marks[STACK_ENV], owner, None)
    try:
        cwd = Path(os.readlink(proc / "cwd").removesuffix(" (deleted)"))
    except OSError:
        return None
    if cwd.name == "redis" and STACK_ID_PATTERN.fullmatch(cwd.parent.name):
        return StackProcess(pid, cwd.parent.name, None, cwd.parent)
    return None


def scan_stack_processes() -> list[StackProcess]:
    """Every live process of any stack, except this one and its ancestors, by pid."""
    spared = _self_and_ancestors()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in spared:
            continue
        process = _stack_process(entry)
        if process is not None and pid_alive(process.pid):
            found.append(process)
    return sorted(found, key=lambda p: p.pid)


def find_stack_processes(stack_id: str | None = None) -> list[int]:
    """Pids of live processes marked with `stack_id` (any stack when None), except this one
    and its ancestors."""
    return [p.pid for p in scan_stack_processes() if stack_id in (None, p.stack_id)]


def _self_and_ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pids


def stop_stack_processes(stack_id: str | None = None, grace_s: float = 3.0) -> list[int]:
    """Stop every live process marked with `stack_id` (all stacks when None)."""
    return stop_pids(find_stack_processes(stack_id), grace_s=grace_s)


def http_get_status(url: str, timeout_s: float = 1.0) -> int | None:
    """HTTP status of GET `url`, or None when nothing answered in time."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def wait_until(
    what: str,
    check: Callable[[], bool],
    timeout_s: float,
    *,
    process: subprocess.Popen[bytes] | None = None,
    log_path: Path | None = None,
    interval_s: float = 0.05,
) -> None:
    """Poll `check` until it is true.

    Raises ComponentNotReady naming `what` (and the log's last lines) when the deadline passes
    or `process` exits first.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return
        if process is not None and process.poll() is not None:
            raise ComponentNotReady(
                f"{what} exited with code {process.returncode} before it was ready"
                + _log_tail(log_path)
            )
        if time.monotonic() >= deadline:
            raise ComponentNotReady(
                f"{what} not ready after {timeout_s:.0f} s" + _log_tail(log_path)
            )
        time.sleep(interval_s)


def _log_tail(log_path: Path | None, lines: int = 5) -> str:
    if log_path is None or not log_path.exists():
        return ""
    tail = log_path.read_text(errors="replace").strip().splitlines()[-lines:]
    return f" (log {log_path}: " + " | ".join(tail) + ")" if tail else f" (log {log_path} is empty)"
