"""Load processes seen through /proc (Linux): is the owner still there, where are stray loads.

Plain Python, no gevent: the master's owner watchdog (process.py) and the library's
`find_load_processes` (api.py) both use it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["LOAD_ENV", "Owner", "find_marked", "start_ticks"]

LOAD_ENV = "LLMCHAOS_LOAD"
"""Environment marker of every load process (the Locust master and the workers it forks); its
value is the run folder, absolute. A cleanup finds stray loads by it in /proc/<pid>/environ."""


def start_ticks(pid: int) -> int | None:
    """Start time of the live process `pid` (clock ticks after boot); None when there is no
    such process or it is a zombie (dead, not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # After the command name (in parentheses, may hold spaces): field 3 (state) onwards.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22: starttime


class Owner:
    """The process a load belongs to, known by pid and start time: a reused pid is not it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._start = start_ticks(pid)

    def gone(self) -> bool:
        return self._start is None or start_ticks(self.pid) != self._start


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
