"""The processes llmchaos starts for a hosts target, kept alive like a kubelet keeps pods.

A thread of the run's process watches them every 0.1 s: a server that dies is restarted with
its `restart_command` after its `restart_delay_s` (what is left of its process group is
killed first, so the port is free); gateways are not restarted here (a crashed gateway stays
down until restore_gateway). Every outage (death, restart, ready again) is kept for the
recovery facts, also of servers the user runs, which are only watched until they answer again.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from llmchaos.errors import ComponentNotReady, InvalidInput
from llmchaos.processes import Owner
from llmchaos.stack.procs import http_get_status
from llmchaos.targets.hosts.procs import (
    HOSTS_ENV,
    OWNER_ENV,
    group_members,
    kill_all,
    launch,
    wait_gone,
)
from llmchaos.targets.hosts.state import TargetState
from llmchaos.targets.hosts.topology import HostsTopology, Part, Server

__all__ = ["Outage", "Supervisor", "answers"]

log = logging.getLogger("chaostoolkit")

_TICK_S = 0.1
_READ_TIMEOUT_S = 0.5


@dataclass
class Outage:
    """One part down and back: Krkn's rescheduling (death until started again) and readiness
    (started until it answers) times come from it."""

    name: str
    node: str
    died_at: float
    restarted_at: float | None = None
    ready_at: float | None = None
    seen_down: bool = False
    """Its health check failed since the death (a user's server restarted by its own
    supervisor counts as ready only after that)."""

    def fact(self, restarts: int) -> dict[str, Any]:
        fact: dict[str, Any] = {
            "name": self.name,
            "node": self.node,
            "died_at": self.died_at,
            "restarts": restarts,
            "rescheduling_time_s": _gap(self.died_at, self.restarted_at),
        }
        if self.ready_at is not None:
            start = self.restarted_at if self.restarted_at is not None else self.died_at
            fact["readiness_time_s"] = _gap(start, self.ready_at)
            fact["total_recovery_time_s"] = _gap(self.died_at, self.ready_at)
        return fact


def _gap(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 3)


def answers(part: Part, timeout_s: float = _READ_TIMEOUT_S) -> bool:
    """The part serves: its health path answers 200 (Redis: its port accepts a connection)."""
    if not part.health:
        with (
            contextlib.suppress(OSError),
            socket.create_connection((part.host, part.port), timeout_s),
        ):
            return True
        return False
    return http_get_status(part.url + part.health, timeout_s) == 200


class Supervisor:
    """See the module docstring. Thread-safe; `stop()` ends the watch and every process."""

    def __init__(
        self, topology: HostsTopology, state: TargetState, owner: Owner, token: str | None
    ) -> None:
        self.topology = topology
        self.state = state
        self.owner = owner
        self.token = token
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._held: set[str] = set()
        """Parts not to restart (a crashed gateway until restore_gateway)."""
        self._restart_due: dict[str, float] = {}
        self.outages: list[Outage] = []
        self._restarts: dict[str, int] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hosts-supervisor", daemon=True)

    # -- starting ------------------------------------------------------------------------
    def _values(self, part: Part) -> dict[str, str]:
        return {
            "python": sys.executable,
            "dir": str(self.topology.path.resolve().parent),
            "state": str(self.state.part_dir(part.name)),
            "port": str(part.port),
            "name": part.name,
        }

    def start(self, part: Part, restart: bool = False) -> subprocess.Popen[bytes]:
        """Start `part` (its restart command when `restart`), recorded in hosts.json."""
        values = self._values(part)
        argv = [arg.format(**values) for arg in (part.restart_command if restart else part.command)]
        env = {k: v.format(**values, token=self.token or "") for k, v in part.env.items()}
        marks = {HOSTS_ENV: self.state.target_id, OWNER_ENV: self.owner.to_marker()}
        log_path = self.state.part_dir(part.name) / "process.log"
        with self._lock:
            process, ticks = launch(argv, env=env, marks=marks, log_path=log_path, netns=part.netns)
            self._procs[part.name] = process
            self.state.record_process(part.name, part.role, process.pid, ticks)
            self._held.discard(part.name)
        return process

    def wait_ready(self, parts: list[Part]) -> None:
        """Wait until every one of `parts` answers; ComponentNotReady names the first that
        exits or misses its `ready_timeout_s`, with the end of its log."""
        started = time.monotonic()
        pending = list(parts)
        while pending:
            for part in list(pending):
                process = self._procs.get(part.name)
                if answers(part):
                    pending.remove(part)
                elif process is not None and process.poll() is not None:
                    raise ComponentNotReady(
                        f"{self.topology.path}: {part.role} {part.name} exited with code "
                        f"{process.returncode} before it answered{self._tail(part)}"
                    )
                elif time.monotonic() - started > part.ready_timeout_s:
                    raise ComponentNotReady(
                        f"{self.topology.path}: {part.role} {part.name} did not answer "
                        f"{part.url}{part.health} within {part.ready_timeout_s:g} s "
                        f"(ready_timeout_s){self._tail(part)}"
                    )
            time.sleep(0.1)

    def _tail(self, part: Part) -> str:
        path = self.state.part_dir(part.name) / "process.log"
        try:
            lines = path.read_text(errors="replace").strip().splitlines()[-4:]
        except OSError:
            return ""
        return f" (log {path}: " + " | ".join(lines) + ")" if lines else f" (log {path} is empty)"

    def watch(self) -> None:
        """Start the watch thread."""
        self._thread.start()

    # -- what the faults tell it ---------------------------------------------------------
    def pid(self, name: str) -> int | None:
        """Pid of the live process llmchaos started for `name`."""
        with self._lock:
            process = self._procs.get(name)
            return process.pid if process is not None and process.poll() is None else None

    def pgid(self, name: str) -> int | None:
        with self._lock:
            process = self._procs.get(name)
            return process.pid if process is not None else None

    def owns(self, name: str) -> bool:
        return name in self._procs

    def hold(self, name: str) -> None:
        """Do not restart `name` until it is started again (a crashed gateway)."""
        with self._lock:
            self._held.add(name)

    def note_down(self, part: Part, at: float) -> None:
        """`part` was killed at `at`: an outage until it answers again."""
        with self._lock:
            node = part.node if isinstance(part, Server) else ""
            if not any(o.name == part.name and o.ready_at is None for o in self.outages):
                self.outages.append(Outage(part.name, node, at))

    def note_restarted(self, name: str, at: float) -> None:
        with self._lock:
            self._restarts[name] = self._restarts.get(name, 0) + 1
            for outage in self.outages:
                if outage.name == name and outage.restarted_at is None:
                    outage.restarted_at = at

    # -- the watch -----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(_TICK_S):
            try:
                self._tick()
            except Exception:  # a watch that dies silently would stop every restart
                log.exception("llmchaos: hosts supervisor")

    def _tick(self) -> None:
        now = time.time()
        for server in self.topology.servers:
            with self._lock:
                process = self._procs.get(server.name)
                if process is None or server.name in self._held:
                    continue
                if process.poll() is not None and server.name not in self._restart_due:
                    self.note_down(server, now)
                    self._restart_due[server.name] = now + server.restart_delay_s
                    # what is left of it (children holding the port) goes too, as a kubelet
                    # removes a dead pod's containers
                    kill_all(group_members(process.pid, None))
                due = self._restart_due.get(server.name)
            if due is not None and now >= due:
                with self._lock:
                    del self._restart_due[server.name]
                    wait_gone(group_members(process.pid, None), 2.0)
                    try:
                        self.start(server, restart=True)
                    except InvalidInput as exc:
                        log.error("llmchaos: cannot restart %s: %s", server.name, exc)
                        continue
                    self.note_restarted(server.name, time.time())
                log.info("llmchaos: restarted %s (%s)", server.name, self.topology.path.name)
        self._check_readiness()

    def _check_readiness(self) -> None:
        with self._lock:
            pending = [o for o in self.outages if o.ready_at is None]
        for outage in pending:
            part = self.topology.part(outage.name)
            if answers(part):
                if outage.seen_down or outage.restarted_at is not None:
                    outage.ready_at = time.time()
            else:
                outage.seen_down = True

    def recovery_facts(self, since_ts: float) -> dict[str, Any]:
        with self._lock:
            outages = [o for o in self.outages if o.died_at >= since_ts]
            restarts = dict(self._restarts)
        recovered = [o.fact(restarts.get(o.name, 0)) for o in outages if o.ready_at is not None]
        unrecovered = [o.fact(restarts.get(o.name, 0)) for o in outages if o.ready_at is None]
        return {"recovered": recovered, "unrecovered": unrecovered}

    # -- stopping ------------------------------------------------------------------------
    def stop(self, grace_s: float = 5.0) -> None:
        """End the watch, then SIGTERM every process group started, a role at a time
        (gateways first), SIGKILL what is left of the role after `grace_s`. Safe to call
        twice. A role's processes stop together: an engine worker drains for a second or
        more after SIGTERM, and one after the other that added up."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        with self._lock:
            roles = {self._role(name) for name in self._procs}
            for role in sorted(roles, key=lambda role: _STOP_ORDER[role]):
                processes = [p for name, p in self._procs.items() if self._role(name) == role]
                pids: list[int] = []
                for process in processes:
                    members = group_members(process.pid, None)
                    kill_all(members, 15)
                    pids += [*members, process.pid]
                left = wait_gone(pids, grace_s)
                kill_all(left)
                wait_gone(left, 2.0)
                for process in processes:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(timeout=1.0)

    def _role(self, name: str) -> str:
        return self.topology.part(name).role


_STOP_ORDER = {"gateway": 0, "server": 1, "redis": 2}
