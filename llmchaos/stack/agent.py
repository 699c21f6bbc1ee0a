"""Node agent: the local stand-in for a kubelet.

Runs on its node (inside the node's network namespace when there is one), starts the node's
engine workers, and restarts one that dies after `restart_delay_s`; the worker then reports
not-ready until its model is loaded. Its state file (`AgentState`) always names the live pid
of every worker, so actions can kill "the GPU process" and probes can count restarts.

    python -m llmchaos.stack.agent --settings agent.json

Workers are forked from the agent, which has their code imported already: a node of the
1,400-QPS fleet has 2-3 of them, and a new interpreter importing the worker's modules took 0.15
CPU-s each, about 3 s of a 44-worker stack's start on 2 cores. They get PR_SET_PDEATHSIG=SIGKILL:
when the agent itself is killed, its workers go too.

With a replicas file (the embedded autoscaler's, like a Deployment's `spec.replicas`), a
worker with an `ordinal` runs only while its ordinal is below its pool's replica count: the
agent starts it when it is scaled out (a full model load, like a new pod) and stops it when
scaled in (a stop, not a death: it is not restarted and counts no restart).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import FrameType

from llmchaos.stack.procs import (
    http_get_status,
    set_parent_death_signal,
    set_process_name,
    stop_pids,
)
from llmchaos.stack.settings import load_settings
from llmchaos.stack.topology import WorkerState, read_replicas

__all__ = ["AgentSettings", "AgentWorker", "main"]

log = logging.getLogger("llmchaos.agent")

_READY_PROBE_TIMEOUT_S = 0.2
"""One readiness check of a loading worker; the agent's loop is 50 ms."""


@dataclass(frozen=True)
class AgentWorker:
    """A worker the agent keeps running."""

    name: str
    settings_path: str
    log_path: str
    health_url: str = ""
    """The worker's /healthz: the agent notes when a started worker is first ready (its
    readiness time, as a kubelet's readiness probe would), "" to skip."""
    pool: str = ""
    """The pool whose replica count this worker follows (gpu); "" = always runs."""
    ordinal: int = 0
    """The worker's index in its pool: it runs while ordinal < the pool's replicas."""


@dataclass(frozen=True)
class AgentSettings:
    """Settings of one node agent."""

    node: str = "node-a"
    """Node name."""
    state_path: str = "agent.json"
    """Where the agent writes its `AgentState`."""
    restart_delay_s: float = 0.5
    """Wait before restarting a worker that died (a kubelet's back-off, kept short)."""
    workers: tuple[AgentWorker, ...] = ()
    """Workers of this node."""
    replicas_path: str = ""
    """The stack's replicas file ({"gpu": N}); "" = every worker always runs."""


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class _ForkedWorker:
    """A worker process forked from the agent, with the part of subprocess.Popen's interface
    the agent uses (pid, poll, returncode, wait)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def start(cls, name: str, argv: list[str], log_path: Path) -> _ForkedWorker:
        """Fork, and run `llmchaos.stack.worker.main(argv)` in the child, named `name` in ps,
        its output appended to `log_path`."""
        from llmchaos.stack.worker import main as worker_main  # here: only agents need it

        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()  # or the child writes the agent's buffered lines again
        sys.stderr.flush()
        agent_pid = os.getpid()
        # held until the child has the default handlers: a SIGTERM meant for the worker must
        # not land in the agent's handler, copied into the child
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            pid = os.fork()
        except BaseException:
            os.close(log_fd)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            raise
        if pid == 0:
            code = 1
            try:
                set_parent_death_signal()
                if os.getppid() != agent_pid:  # the agent died before the line above
                    os._exit(1)
                set_process_name(name)
                for sig in _STOP_SIGNALS:  # the agent's: the worker sets its own
                    signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
                null_fd = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null_fd, 0)
                os.dup2(log_fd, 1)
                os.dup2(log_fd, 2)
                os.close(null_fd)
                os.close(log_fd)
                logging.root.handlers.clear()  # the agent's format; the worker sets its own
                code = worker_main(argv)
            except SystemExit as exc:  # as the interpreter would exit
                if exc.code is None or isinstance(exc.code, int):
                    code = exc.code or 0
                else:
                    print(exc.code, file=sys.stderr)
            except BaseException:  # a child must never return into the agent's loop
                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        os.close(log_fd)
        return cls(pid)

    def poll(self) -> int | None:
        """The exit code (-N: killed by signal N) once the worker ended, else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (stop_pids): as Popen, say 0
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        """The exit code; raises subprocess.TimeoutExpired after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


class _Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.procs: dict[str, _ForkedWorker] = {}
        self.unreaped: list[_ForkedWorker] = []
        """Scaled-in workers still on their way out."""
        self.states: dict[str, WorkerState] = {}
        self.restart_at: dict[str, float] = {}
        self.stopping = False
        self.booted = False
        """After the first round of starts: later starts load the model in full."""
        self._replicas: dict[str, int] = {}
        self._replicas_mtime = -1.0

    def start(self, worker: AgentWorker, *, after_death: bool = False) -> None:
        """Start `worker`: at boot with its first model load, later (a restart after a death,
        or a scale-out) with the full one; only a restart after a death counts."""
        argv = ["--settings", worker.settings_path]
        previous = self.states.get(worker.name)
        if previous is not None or self.booted:
            argv.append("--restart")
        proc = _ForkedWorker.start(worker.name, argv, Path(worker.log_path))
        self.procs[worker.name] = proc
        restarts = (previous.restarts if previous else 0) + (1 if after_death else 0)
        self.states[worker.name] = WorkerState(
            pid=proc.pid,
            started_at=time.time(),
            restarts=restarts,
            last_exit_code=previous.last_exit_code if previous else None,
            last_exit_at=previous.last_exit_at if previous else None,
        )
        log.info("started %s pid %d (restarts %d)", worker.name, proc.pid, restarts)

    def write_state(self) -> None:
        path = Path(self.settings.state_path)
        data = {
            "node": self.settings.node,
            "agent_pid": os.getpid(),
            "updated_at": time.time(),
            "workers": {name: asdict(state) for name, state in self.states.items()},
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)

    def wanted(self, worker: AgentWorker) -> bool:
        """Whether `worker` should run now: always, or while its ordinal is below its pool's
        replica count (the file is read again when it changes)."""
        if not worker.pool or not self.settings.replicas_path:
            return True
        path = Path(self.settings.replicas_path)
        try:
            mtime = path.stat().st_mtime
            if mtime != self._replicas_mtime:
                self._replicas, self._replicas_mtime = read_replicas(path), mtime
        except (OSError, ValueError):
            pass  # unreadable for a moment: keep the last count
        return worker.ordinal < self._replicas.get(worker.pool, 0)

    def scale_in(self, worker: AgentWorker) -> None:
        """Stop a running worker its pool no longer wants (not a death: no restart). One
        SIGTERM: it drains (llmchaos.stack.worker) within the 2 s before the SIGKILL."""
        proc = self.procs.pop(worker.name)
        stop_pids([proc.pid], grace_s=2.0)
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.unreaped.append(proc)  # reaped by a later step, not left a zombie
        self.restart_at.pop(worker.name, None)
        self.states[worker.name] = replace(self.states[worker.name], running=False)
        log.info("scaled in %s (pid %d)", worker.name, proc.pid)

    def step(self) -> bool:
        """Reap dead workers, restart due ones, start and stop workers as their pool's
        replica count says, note when started ones are ready; True when the state changed."""
        changed = False
        now = time.monotonic()
        self.unreaped = [proc for proc in self.unreaped if proc.poll() is None]
        for worker in self.settings.workers:
            state = self.states.get(worker.name)
            wanted = self.wanted(worker)
            if not wanted:
                if worker.name in self.procs:
                    self.scale_in(worker)
                    changed = True
                self.restart_at.pop(worker.name, None)
                continue
            if worker.name not in self.procs and worker.name not in self.restart_at:
                self.start(worker)  # scaled out (or never started)
                changed = True
                continue
            if (
                worker.health_url
                and worker.name in self.procs
                and state is not None
                and state.ready_at is None
                and http_get_status(worker.health_url, _READY_PROBE_TIMEOUT_S) == 200
            ):
                self.states[worker.name] = replace(state, ready_at=time.time())
                changed = True
            proc = self.procs.get(worker.name)
            if proc is not None and proc.poll() is not None:
                del self.procs[worker.name]
                self.states[worker.name] = replace(
                    self.states[worker.name],
                    running=False,
                    last_exit_code=proc.returncode,
                    last_exit_at=time.time(),
                )
                self.restart_at[worker.name] = now + self.settings.restart_delay_s
                log.warning("%s exited with %s", worker.name, proc.returncode)
                changed = True
            if worker.name in self.restart_at and now >= self.restart_at[worker.name]:
                del self.restart_at[worker.name]
                self.start(worker, after_death=True)
                changed = True
        return changed

    def run(self) -> int:
        for worker in self.settings.workers:
            if self.wanted(worker):
                self.start(worker)
        self.booted = True
        self.write_state()
        while not self.stopping:
            if self.step():
                self.write_state()
            time.sleep(0.05)
        # the node is going away, not scaling in: nothing routes here any more and a worker
        # keeps nothing, so SIGKILL (an interpreter's orderly exit, times the fleet's workers
        # on 2 cores, held each run's finish up by a second)
        stop_pids([p.pid for p in self.procs.values()], grace_s=0.0, terms=0)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmchaos.stack.agent")
    parser.add_argument("--settings", type=Path, required=True, help="AgentSettings JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    agent = _Agent(load_settings(AgentSettings, args.settings))

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        agent.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
