"""Processes seen through /proc (Linux): alive or not, who owns what, marked processes.

    Owner.this_process("run", run_dir)   # a stack or load belongs to this chaos run
    owner.alive()                        # same pid *and* same start time: a reused pid is not it
    find_marked("LLMCHAOS_LOAD")         # pid -> marker value, from /proc/<pid>/environ

Plain Python (no gevent, no asyncio): the stack, the load and the run layer all use it.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "Owner",
    "OwnerKind",
    "allow_open_files",
    "find_marked",
    "group_members",
    "pid_alive",
    "process_state",
    "start_ticks",
    "stat_fields",
    "stop_group",
    "stop_pids",
    "wait_for_state",
]


def process_state(pid: int) -> str | None:
    """The kernel's state letter of process `pid` (R running, S sleeping, T stopped by a
    signal, Z zombie, ...: proc(5)); None when there is no such process."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def wait_for_state(pid: int, state: str, timeout_s: float = 1.0) -> str | None:
    """The state of `pid` as soon as it is `state`, else the last one seen after `timeout_s`
    (None: no such process). A signal takes effect when its process next runs, which on a
    busy machine can be a moment after it was sent (a second is plenty)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = process_state(pid)
        if seen in (state, None) or time.monotonic() >= deadline:
            return seen
        time.sleep(0.02)


def start_ticks(pid: int) -> int | None:
    """Start time of the live process `pid` (clock ticks after boot); None when there is no
    such process or it is a zombie (dead, not yet reaped by its parent)."""
    fields = stat_fields(pid)
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22: starttime


def stat_fields(pid: int | str) -> list[str] | None:
    """Fields 3 (state) onwards of /proc/<pid>/stat, after the command name (in parentheses,
    may hold spaces): [state, ppid, pgrp, ...]; None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):  # ended meanwhile
        return None


def pid_alive(pid: int) -> bool:
    """True when `pid` exists and is not a zombie."""
    return start_ticks(pid) is not None


OwnerKind = Literal["run", "user"]
"""run: a chaos run (or a load) that ends with its process; user: a `stack up` stack, which
lives until someone stops it (`stack down`, `cleanup --stack ID`)."""


@dataclass(frozen=True)
class Owner:
    """Whom a stack, a load or a run folder belongs to."""

    kind: OwnerKind
    pid: int
    """The process that started it (for a `user` stack: `stack up`, gone once it is up)."""
    start_ticks: int | None
    """Its start time: with the pid, it names one process even after the pid is reused."""
    run_dir: str | None = None
    """The chaos run's folder, for kind run."""

    @classmethod
    def of(cls, pid: int, kind: OwnerKind = "run", run_dir: str | None = None) -> Owner:
        """Process `pid` as it is now (its start time read from /proc)."""
        return cls(kind, pid, start_ticks(pid), run_dir)

    @classmethod
    def this_process(cls, kind: OwnerKind, run_dir: str | None = None) -> Owner:
        return cls.of(os.getpid(), kind, run_dir)

    def alive(self) -> bool:
        """The starting process still runs (not a zombie, not a reused pid)."""
        return self.start_ticks is not None and start_ticks(self.pid) == self.start_ticks

    def describe(self) -> str:
        state = "alive" if self.alive() else "gone"
        if self.kind == "run":
            return f"chaos run pid {self.pid} ({state}), run folder {self.run_dir or '-'}"
        return f"`llmchaos stack up` (pid {self.pid}, {state})"

    def to_marker(self) -> str:
        """One line for an environment variable: kind:pid:start_ticks."""
        return f"{self.kind}:{self.pid}:{self.start_ticks if self.start_ticks is not None else ''}"

    @classmethod
    def from_marker(cls, text: str) -> Owner | None:
        """The owner a marker names; None for anything else."""
        kind, _, rest = text.partition(":")
        pid, _, ticks = rest.partition(":")
        if kind not in ("run", "user") or not pid.isdigit():
            return None
        return cls(kind, int(pid), int(ticks) if ticks.isdigit() else None)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Owner | None:
        """The owner recorded in a state file; None when it is not one."""
        try:
            owner = cls(
                data["kind"],
                int(data["pid"]),
                None if data.get("start_ticks") is None else int(data["start_ticks"]),
                data.get("run_dir"),
            )
        except (KeyError, TypeError, ValueError):
            return None
        return owner if owner.kind in ("run", "user") else None


def find_marked(name: str) -> dict[int, str]:
    """pid -> value of environment variable `name`, for every process carrying it that this
    user may read, except this process. Processes that end meanwhile are skipped."""
    prefix = name.encode() + b"="
    me = os.getpid()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            # A zombie's environ is empty, so ended processes are not found.
            environ = (entry / "environ").read_bytes()
        except OSError:  # ended meanwhile, or another user's
            continue
        for item in environ.split(b"\0"):
            if item.startswith(prefix):
                found[int(entry.name)] = item[len(prefix) :].decode(errors="replace")
                break
    return found


def group_members(pgid: int, leader_ticks: int | None = None) -> list[int]:
    """Live (not zombie) processes of process group `pgid`; with `leader_ticks` (the leader's
    start time), only those started no earlier (a reused group id is not taken for ours)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(entry.name)
        if not fields or fields[0] in ("Z", "X") or int(fields[2]) != pgid:  # field 5: pgrp
            continue
        if leader_ticks is None or int(fields[19]) >= leader_ticks:
            members.append(int(entry.name))
    return members


def stop_group(leader: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM the process group `leader` heads, SIGKILL it after `grace_s`; returns once no
    process of the group is alive. A child it forked can outlive the leader by a moment (a
    Locust worker does), so the leader's exit alone does not end the group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if _group_gone(leader):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(leader.pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if _group_gone(leader):
                return
            time.sleep(0.05)


def _group_gone(leader: subprocess.Popen[bytes]) -> bool:
    """No process of `leader`'s group is alive. Once the leader is reaped its pid can be
    handed out again, and a process that starts a session of its own then heads a group of
    the same id: not ours (pids wrap every few minutes on a busy box at pid_max 32768). The
    kernel does not reuse a pid that is still some group's id, so our group is gone by then."""
    leader.poll()  # reaped, the leader no longer counts as a member
    if leader.returncode is not None and pid_alive(leader.pid):
        return True
    return not group_members(leader.pid)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def stop_pids(pids: Sequence[int], grace_s: float = 3.0, terms: int = 1) -> list[int]:
    """SIGTERM `pids` (`terms` times: a second tells an engine worker not to drain), SIGKILL
    what is still alive after `grace_s`; returns the pids that were alive at the start. A pid
    whose process ended and was handed to a new one meanwhile is left alone (its start time
    no longer matches)."""
    started = {pid: start_ticks(pid) for pid in pids}
    alive = [pid for pid, ticks in started.items() if ticks is not None]

    def still_ours(pid: int) -> bool:
        return start_ticks(pid) == started[pid]

    for _ in range(terms):
        for pid in alive:
            if still_ours(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    remaining = list(alive)
    while remaining and time.monotonic() < deadline:
        for pid in remaining:
            _reap(pid)
        remaining = [pid for pid in remaining if still_ours(pid)]
        if remaining:
            time.sleep(0.05)
    for pid in remaining:
        if still_ours(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    for pid in remaining:
        _wait_gone(pid, 2.0)
    return alive


def _wait_gone(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pid)
        if not pid_alive(pid):
            return
        time.sleep(0.02)


def allow_open_files(wanted: int) -> int:
    """Raise this process's soft open-file limit to `wanted` (never past the hard limit; the
    processes it starts inherit it) and return the soft limit in effect, `wanted` or less.

    A connection per request in flight: the load at 1,200 QPS holds up to ~10,000, and
    HAProxy sizes its maxconn from the limit it starts with (1,024 on many machines)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return wanted
    limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if limit > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        except (ValueError, OSError):  # above fs.nr_open, or a platform's OPEN_MAX
            return soft
    return limit
