"""The user's own serving processes as a live target: faults that are checked to have taken
effect, their undo, and readings in each engine's own terms.

- kill_gpu_process: SIGKILL the pids `nvidia-smi --query-compute-apps=pid` lists inside the
  server's process tree; without nvidia-smi (or when it lists none of them) the server's pid.
  Checked: the pids are gone.
- hang_gpu_process / resume_gpu_process: SIGSTOP / SIGCONT the same pids (a hung GPU).
- crash_gateway: SIGKILL every process listening on the gateway's port, its own process and
  their descendants (nginx: master and workers). Checked: all gone, the port free.
- restore_gateway: wait for the port to be free, run its restart command, wait for its health
  path to answer 200.
- partition_node: iptables DROP on the port of each server of the node, both directions (the
  host's filter table, or inside the server's netns). Checked: a connect times out and the
  rules' packet counter rises.
- expire_token_cache: DEL (ttl_s 0) or PEXPIRE the keys of `redis.key_pattern`.
- throttle_cpu / unthrottle_cpu: the part's process and its children into a cgroup of ours
  (`llmc-hosts-<target id>-<part>`) with a CPU quota (llmchaos.targets.cpu_throttle); back
  where they were at the undo, or when the target is removed. Checked: the kernel's throttling
  counters rising.
- degrade_network / restore_network: loss (iptables statistic DROP) and delay (NFQUEUE to a
  delayer llmchaos starts, llmchaos.stack.nfqueue) on the ports of the node's servers, tagged
  like a partition (`<node>+loss`, `<node>+delay`). Checked: the rules' counters rising, each
  delayer holding packets as asked. No bandwidth cap (tbf shapes a whole device).
- gpu_errors, slow_gpu, oom_kill_worker: not on processes llmchaos did not build
  (TargetInfo.unsupported says why).

Each fault is checked again after it went in (`verify_<fault>`, the evidence kept in the
ledger): the pids gone and, for a server, a new pid from the supervisor; nothing of the killed
pids serving the gateway's port; the partition rules' packet counters above zero; each token
key gone, expiring within ttl_s, or cached again since.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import zlib
from pathlib import Path
from typing import Any

from llmchaos.errors import InvalidInput, StackError
from llmchaos.ledger import Verification
from llmchaos.processes import Owner, find_marked, pid_alive, wait_for_state
from llmchaos.stack import cgroups, nfqueue
from llmchaos.targets import Target, TargetInfo, WorkerRef, cpu_throttle
from llmchaos.targets.cache import expire_keys, expiry_verification, key_ttls
from llmchaos.targets.hosts import firewall
from llmchaos.targets.hosts.engines import EngineReading, read_engine
from llmchaos.targets.hosts.procs import (
    HOSTS_ENV,
    OWNER_ENV,
    descendants,
    group_members,
    kill_all,
    launch,
    listeners,
    read_pid_file,
    wait_gone,
)
from llmchaos.targets.hosts.state import TargetState, remove_target
from llmchaos.targets.hosts.supervisor import Supervisor, answers
from llmchaos.targets.hosts.topology import Gateway, HostsTopology, Part, Server

__all__ = ["HostsTarget", "planned_info"]

_READ_TIMEOUT_S = 0.5
_KILL_WAIT_S = 3.0
_PORT_FREE_WAIT_S = 10.0
_PROBE_CONNECT_S = 0.3
_COUNTERS_RISE_S = 5.0
"""How long a check waits for a rule's packet counter to rise."""
_DELAY_QUEUE_BASE = 20_000
"""NFQUEUE numbers of the hosts target's delayers: this plus a hash of target and node (the
host's namespace is shared with whatever else uses NFQUEUE)."""
_NEEDS_ENGINE_HOOK = (
    "a GPU fault while the server stays up needs a hook inside the engine (Dynamo injects Xid "
    "and CUDA errors with LD_PRELOAD into CUDA), which a server on this machine without a GPU "
    "does not have; the embedded stack's workers take it on their control port"
)


def partitions_supported() -> bool:
    """Root and iptables: what a partition needs here."""
    return os.geteuid() == 0 and shutil.which("iptables") is not None


def planned_info(topology: HostsTopology) -> TargetInfo:
    """The names the file gives, for checking an experiment before anything starts."""
    return TargetInfo(
        nodes=topology.nodes(),
        workers=tuple(WorkerRef(s.name, s.mode, s.node) for s in topology.servers),
        gateways=tuple(g.name for g in topology.gateways),
        partitions_supported=partitions_supported(),
        partitions_need="root and iptables on this machine",
        unsupported=_unsupported(),
    )


def _unsupported() -> dict[str, str]:
    """What the hosts target cannot do to the user's processes, and why (see TargetInfo)."""
    unsupported = {
        "gpu_errors": _NEEDS_ENGINE_HOOK,
        "slow_gpu": _NEEDS_ENGINE_HOOK,
        "oom_kill_worker": "an OOM kill needs the server to grow past a memory limit, which "
        "llmchaos cannot make a server it did not build do (the embedded stack's workers grow "
        "on command)",
        "degrade_network:rate_kbit": "a bandwidth cap (tc tbf) shapes a whole device, and "
        "hosts servers share the loopback with everything else; loss and delay are per port",
    }
    if (reason := cgroups.support("cpu")) is not None:
        unsupported["throttle_cpu"] = reason
    if not partitions_supported():
        unsupported["degrade_network"] = "needs root and iptables on this machine"
    elif (reason := nfqueue.support()) is not None:
        unsupported["degrade_network:delay_ms"] = reason
    return unsupported


class HostsTarget(Target):
    """A hosts file's processes, opened for one run (or reattached after its owner died:
    then without a supervisor)."""

    def __init__(
        self,
        topology: HostsTopology,
        state: TargetState,
        owner: Owner,
        supervisor: Supervisor | None,
        tokens_file: Path | None,
    ) -> None:
        self.topology = topology
        self.state = state
        self.owner = owner
        self.supervisor = supervisor
        self._tokens_file = tokens_file
        self._closed = False
        self._token_snapshot: tuple[float, dict[bytes, int]] = (0.0, {})
        self._hung: dict[str, list[int]] = {}

    def info(self) -> TargetInfo:
        return planned_info(self.topology)

    @property
    def gateway_url(self) -> str:
        return self.topology.front_url

    @property
    def tokens_file(self) -> str | None:
        return str(self._tokens_file) if self._tokens_file else None

    def record(self) -> dict[str, Any]:
        return {"hosts_state_dir": str(self.state.state_dir)}

    def close(self) -> None:
        """Stop what llmchaos started, remove this target's partition rules. Safe twice."""
        if self._closed:
            return
        self._closed = True
        if self.supervisor is not None:
            self.supervisor.stop()
        remove_target(self.state)

    # -- where a part runs now -----------------------------------------------------------
    def _pid(self, part: Part) -> int | None:
        """Its main process now: the one llmchaos started, the pid file's, or the given pid;
        None when it does not run."""
        if part.started_by_us:
            return self.supervisor.pid(part.name) if self.supervisor else None
        if part.pid_file:
            try:
                pid = read_pid_file(part.pid_file)
            except InvalidInput:
                return None
        else:
            pid = part.pid
        return pid if pid is not None and pid_alive(pid) else None

    # -- faults --------------------------------------------------------------------------
    def kill_gpu_process(self, worker: str) -> dict[str, Any]:
        server = self.topology.server(worker)
        pid = self._pid(server)
        if pid is None:
            raise StackError(f"{worker}: not running, no GPU process to kill")
        pids, via = _gpu_pids(pid)
        at = time.time()
        kill_all(pids)
        left = wait_gone(pids, _KILL_WAIT_S)
        if left:
            raise StackError(
                f"{worker}: GPU process(es) {left} still alive {_KILL_WAIT_S:g} s after SIGKILL"
            )
        if self.supervisor is not None:
            self.supervisor.note_down(server, at)
        return {"worker": worker, "pid": pids[0], "pids": pids, "via": via}

    def hang_gpu_process(self, worker: str) -> dict[str, Any]:
        """SIGSTOP the GPU pids of the server (as kill_gpu_process finds them): its port still
        accepts connections, nothing answers. The supervisor restarts only what exits."""
        server = self.topology.server(worker)
        pid = self._pid(server)
        if pid is None:
            raise StackError(f"{worker}: not running, no GPU process to hang")
        pids, via = _gpu_pids(pid)
        kill_all(pids, signal.SIGSTOP)
        self._hung[worker] = pids
        return {"worker": worker, "pid": pids[0], "pids": pids, "via": via}

    def resume_gpu_process(self, worker: str) -> None:
        """SIGCONT what hang_gpu_process stopped (idempotent)."""
        kill_all(self._hung.pop(worker, []), signal.SIGCONT)

    def verify_hang_gpu_process(self, details: dict[str, Any]) -> Verification:
        """Each pid in state T (stopped by a signal)."""
        # right after the SIGSTOP a busy process may not have stopped yet (seen under load)
        states = {pid: wait_for_state(pid, "T") or "gone" for pid in details["pids"]}
        return Verification(
            all(state == "T" for state in states.values()),
            f"{details['worker']}: "
            + ", ".join(f"pid {p} in state {s}" for p, s in states.items())
            + " (T: stopped)",
        )

    def crash_gateway(self, gateway: str) -> dict[str, Any]:
        part = self.topology.gateway(gateway)
        main = self._pid(part)
        if main is None and not listeners(part.port):
            raise StackError(f"{gateway} is not running: nothing listens on port {part.port}")
        if self.supervisor is not None:
            self.supervisor.hold(gateway)
        at = time.time()
        killed = self._kill_serving(part, main)
        if self.supervisor is not None:
            self.supervisor.note_down(part, at)
        return {"gateway": gateway, "pid": main or killed[0], "pids": killed}

    def _kill_serving(self, part: Gateway, main: int | None) -> list[int]:
        """SIGKILL whatever serves the gateway's port until nothing does: an nginx master
        that sees its worker die before its own SIGKILL lands forks a new worker, which
        keeps the port (measured), so one round is not enough."""
        group = self.supervisor.pgid(part.name) if self.supervisor else None
        killed: list[int] = []
        deadline = time.monotonic() + _KILL_WAIT_S
        while True:
            roots = {*listeners(part.port), *([main] if main else [])}
            roots |= set(group_members(group, None)) if group else set()
            pids = [pid for pid in descendants(roots) if pid_alive(pid)]
            if not pids and not listeners(part.port):
                return sorted(set(killed))
            if time.monotonic() >= deadline:
                raise StackError(
                    f"{part.name}: still serving port {part.port} {_KILL_WAIT_S:g} s after "
                    f"SIGKILL of {sorted(set(killed))} (alive: {pids or listeners(part.port)})"
                )
            killed += kill_all(pids)
            wait_gone(pids, 0.2)

    def restore_gateway(self, gateway: str) -> None:
        """Start `gateway` again unless it answers; wait until it does. Idempotent."""
        part = self.topology.gateway(gateway)
        if answers(part) and listeners(part.port):
            return
        if not _wait(lambda: not listeners(part.port), _PORT_FREE_WAIT_S):
            raise StackError(
                f"{gateway}: port {part.port} still held by {listeners(part.port)}; not restarted"
            )
        if part.started_by_us:
            if self.supervisor is None:
                raise StackError(f"{gateway}: its run is gone; cleanup removes what it started")
            self.supervisor.start(part, restart=True)
        else:
            self._run_restart_command(part)
        if self.supervisor is not None:
            self.supervisor.note_restarted(gateway, time.time())
            self.supervisor.wait_ready([part])
        elif not _wait(lambda: answers(part), part.ready_timeout_s):
            raise StackError(f"{gateway}: no answer at {part.url}{part.health} after its restart")

    def _run_restart_command(self, part: Gateway) -> None:
        try:
            result = subprocess.run(
                list(part.restart_command),
                capture_output=True,
                text=True,
                timeout=part.ready_timeout_s,
                start_new_session=True,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise StackError(f"{part.name}: restart command failed: {exc}") from None
        if result.returncode != 0:
            raise StackError(
                f"{part.name}: restart command exited {result.returncode}: "
                f"{(result.stderr or result.stdout).strip()[-300:]}"
            )

    def _servers_on(self, node: str) -> list[Server]:
        servers = [s for s in self.topology.servers if s.node == node]
        if not servers:
            raise InvalidInput(
                f"node: unknown node {node!r}; nodes: {', '.join(self.topology.nodes())}"
            )
        return servers

    def partition_node(self, node: str, direction: str = "both") -> None:
        """DROP on the port of every server of `node`, both ways or one (requests in, or
        answers out); checked: a connect to each times out and the rules count dropped
        packets (one way cuts the handshake either way)."""
        if not partitions_supported():
            raise InvalidInput("partition_node: needs root and iptables on this machine")
        comment = firewall.tag(self.state.target_id, node, self.owner)
        for server in self._servers_on(node):
            firewall.add_port_drop(server.port, comment, server.netns, direction)
        for server in self._servers_on(node):
            before = firewall.dropped_packets(comment, server.netns)
            outcome = _connect(server.host, server.port)
            after = firewall.dropped_packets(comment, server.netns)
            if outcome != "timeout" or after <= before:
                raise StackError(
                    f"partition of {node}: {server.name} at {server.host}:{server.port} "
                    f"{outcome} (packets dropped {before} -> {after}): the rules did not work"
                )

    def heal_partition(self, node: str) -> None:
        """Remove this target's rules for `node` (idempotent)."""
        comment = firewall.tag(self.state.target_id, node, self.owner)
        for netns in {s.netns for s in self.topology.servers if s.node == node}:
            for rule in firewall.tagged_rules(netns, prefix=comment):
                firewall.delete_rule(rule)

    def _net_tag(self, node: str, kind: str) -> str:
        """The comment of a degradation rule: a partition's tag for node `<node>+<kind>`, so
        heal_partition leaves it alone and the target's cleanup removes it."""
        return firewall.tag(self.state.target_id, f"{node}+{kind}", self.owner)

    def _delay_stats_path(self, node: str, netns: str | None) -> Path:
        return self.state.state_dir / f"delay-{node}-{netns or 'host'}.json"

    def degrade_network(
        self,
        node: str,
        delay_ms: float,
        jitter_ms: float,
        loss_percent: float,
        rate_kbit: float,
        direction: str,
    ) -> dict[str, Any]:
        """Loss and delay on the ports of `node`'s servers (the host's filter table, or the
        server's netns): iptables statistic DROP, and NFQUEUE to a delayer llmchaos starts
        (a process marked as the target's). No bandwidth cap: tbf shapes a whole device."""
        if rate_kbit:
            raise self._unsupported("degrade_network:rate_kbit")
        servers = self._servers_on(node)
        self.restore_network(node)
        details: dict[str, Any] = {"node": node, "direction": direction, "delayers": {}}
        if delay_ms:
            for netns in sorted({s.netns or "" for s in servers}):
                queue = _DELAY_QUEUE_BASE + zlib.crc32(f"{self.state.target_id}/{node}".encode())
                queue %= 1 << 16
                details["delayers"][netns] = self._start_delayer(
                    node, netns or None, queue, delay_ms, jitter_ms
                )
                for server in servers:
                    if (server.netns or "") == netns:
                        firewall.add_port_queue(
                            server.port,
                            self._net_tag(node, "delay"),
                            queue,
                            server.netns,
                            direction,
                        )
        if loss_percent:  # inserted after the queue rules, so before them: lost, not delayed
            for server in servers:
                firewall.add_port_drop(
                    server.port,
                    self._net_tag(node, "loss"),
                    server.netns,
                    direction,
                    share=loss_percent / 100,
                )
        details.update(
            delay_ms=delay_ms, jitter_ms=jitter_ms, loss_percent=loss_percent, rate_kbit=0.0
        )
        return details

    def _start_delayer(
        self, node: str, netns: str | None, queue: int, delay_ms: float, jitter_ms: float
    ) -> int:
        stats = self._delay_stats_path(node, netns)
        stats.unlink(missing_ok=True)
        log = self.state.state_dir / "logs" / f"delay-{node}-{netns or 'host'}.log"
        marks = {HOSTS_ENV: self.state.target_id, OWNER_ENV: self.owner.to_marker()}
        argv = nfqueue.command(queue, delay_ms, jitter_ms, stats)
        process, _ = launch(argv, env={}, marks=marks, log_path=log, netns=netns)
        try:
            nfqueue.wait_bound(process, stats, log)
        except StackError as exc:
            raise StackError(f"{node}: {exc}") from None
        return process.pid

    def restore_network(self, node: str) -> None:
        """Remove `node`'s loss and queue rules, then stop its delayers (they let every held
        packet go). Idempotent."""
        for kind in ("loss", "delay"):
            comment = self._net_tag(node, kind)
            for netns in {s.netns for s in self._servers_on(node)}:
                for rule in firewall.tagged_rules(netns, prefix=comment):
                    firewall.delete_rule(rule)
        ours = {pid for pid, mark in find_marked(HOSTS_ENV).items() if mark == self.state.target_id}
        for netns in {s.netns for s in self._servers_on(node)}:
            stats = nfqueue.read_stats(self._delay_stats_path(node, netns))
            if stats is not None and stats.pid in ours:
                kill_all([stats.pid], signal.SIGTERM)
                wait_gone([stats.pid], _KILL_WAIT_S)

    def expire_token_cache(self, ttl_s: float) -> int:
        spec = self.topology.redis
        if spec is None or not spec.key_pattern:
            raise InvalidInput(
                f"{self.topology.path}: redis.key_pattern: not set, so there is no token cache "
                "to expire (give redis.url and key_pattern, e.g. token:*)"
            )
        password = os.environ.get(spec.password_env) if spec.password_env else None
        before = key_ttls(spec.url, password, spec.url, pattern=spec.key_pattern)
        self._token_snapshot = (ttl_s, before)
        return expire_keys(spec.url, password, spec.key_pattern, ttl_s, spec.url)

    def _cgroup_name(self, part: str) -> str:
        # not a stack's `llmc-<4 hex>-`: the embedded stack's cleanup leaves these alone
        return f"{cgroups.CGROUP_PREFIX}hosts-{self.state.target_id}-{part}"

    def throttle_cpu(self, part: str, cpu_percent: float) -> dict[str, Any]:
        main = self._pid(self.topology.part(part))
        if main is None:
            raise StackError(f"{part} is not running: no process to throttle")
        return cpu_throttle.throttle(
            self._cgroup_name(part), part, descendants([main]), cpu_percent
        )

    def unthrottle_cpu(self, part: str) -> None:
        cpu_throttle.unthrottle(self._cgroup_name(part))

    # -- checks --------------------------------------------------------------------------
    def verify_kill_gpu_process(self, details: dict[str, Any]) -> Verification:
        """Each killed server's pids gone; with a supervisor, running again as a new pid.
        `details` as the run keeps them: {"killed": [what kill_gpu_process returned, ...]}."""
        checks = [self._verify_killed_server(item) for item in details.get("killed") or []]
        if not checks:
            return Verification(False, "no process was killed")
        return Verification(all(c.in_effect for c in checks), "; ".join(c.evidence for c in checks))

    def _verify_killed_server(self, details: dict[str, Any]) -> Verification:
        killed = list(details.get("pids") or [details["pid"]])
        alive = [pid for pid in killed if pid_alive(pid)]
        evidence = f"{details['worker']}: pids {killed} " + (
            f"still alive: {alive}" if alive else "gone"
        )
        if alive or self.supervisor is None:
            return Verification(not alive, evidence)
        part = self.topology.server(str(details["worker"]))
        new = _wait(lambda: (pid := self.supervisor.pid(part.name)) not in (None, *killed), 10.0)
        now = self.supervisor.pid(part.name)
        return Verification(new, evidence + (f"; new pid {now}" if new else "; no new pid"))

    def verify_throttle_cpu(self, details: dict[str, Any]) -> Verification:
        return cpu_throttle.verify_throttle(self._cgroup_name(str(details["part"])), details)

    def verify_degrade_network(self, details: dict[str, Any]) -> Verification:
        """The loss rules dropping and the queue rules queueing on the node's ports (their
        counters rising within a few seconds), and each delayer holding packets as asked."""
        node = str(details["node"])
        namespaces = {s.netns for s in self._servers_on(node)}
        kinds = [
            k for k, on in (("loss", details["loss_percent"]), ("delay", details["delay_ms"])) if on
        ]
        if not kinds:
            return Verification(False, f"{node}: no loss or delay asked")
        lines, in_effect = [], True
        for kind in kinds:
            counting, evidence = self._rules_counting(node, kind, namespaces)
            in_effect = in_effect and counting
            lines.append(evidence)
        for netns, pid in dict(details.get("delayers") or {}).items():
            held, evidence = nfqueue.check_hold(
                self._delay_stats_path(node, netns or None),
                int(pid),
                float(details["delay_ms"]),
                float(details["jitter_ms"]),
            )
            in_effect = in_effect and held
            lines.append(evidence)
        return Verification(in_effect, "; ".join(lines))

    def _rules_counting(
        self, node: str, kind: str, namespaces: set[str | None]
    ) -> tuple[bool, str]:
        """Whether the node's `kind` rules exist and their packet counters rise."""
        comment = self._net_tag(node, kind)
        if not any(firewall.tagged_rules(n, prefix=comment) for n in namespaces):
            return False, f"no {kind} rule on {node}'s ports"

        def counted() -> int:
            return sum(firewall.dropped_packets(comment, n) for n in namespaces)

        before = counted()
        rose = _wait(lambda: counted() > before, _COUNTERS_RISE_S)
        return rose, f"{kind} rules on {node}'s ports: +{counted() - before} packets"

    def verify_crash_gateway(self, details: dict[str, Any]) -> Verification:
        """The killed pids gone and none of them serving the gateway's port."""
        part = self.topology.gateway(str(details["gateway"]))
        killed = list(details.get("pids") or [details["pid"]])
        alive = [pid for pid in killed if pid_alive(pid)]
        serving = sorted(set(listeners(part.port)) & set(killed))
        return Verification(
            not alive and not serving,
            f"{part.name}: pids {killed}: alive {alive}, serving port {part.port}: {serving}",
        )

    def verify_partition_node(self, details: dict[str, Any]) -> Verification:
        """Each server's rules present and counting dropped packets."""
        node = str(details["node"])
        comment = firewall.tag(self.state.target_id, node, self.owner)
        lines, in_effect = [], True
        for netns in sorted({s.netns or "" for s in self._servers_on(node)}):
            rules = firewall.tagged_rules(netns or None, prefix=comment)
            dropped = firewall.dropped_packets(comment, netns or None) if rules else 0
            in_effect = in_effect and bool(rules) and dropped > 0
            where = f"netns {netns}" if netns else "the host"
            lines.append(f"{len(rules)} rules in {where}, {dropped} packets dropped")
        return Verification(in_effect, f"partition of {node}: " + "; ".join(lines))

    def verify_expire_token_cache(self, details: dict[str, Any]) -> Verification:
        spec = self.topology.redis
        ttl_s, before = self._token_snapshot
        if spec is None or not before:
            return expiry_verification(ttl_s, spec.key_pattern if spec else "", before, {})
        password = os.environ.get(spec.password_env) if spec.password_env else None
        now = key_ttls(spec.url, password, spec.url, keys=before)
        return expiry_verification(ttl_s, spec.key_pattern, before, now)

    # -- readings ------------------------------------------------------------------------
    def engine_readings(self) -> dict[str, EngineReading]:
        """Each server's readings in its engine's own names (engines.py)."""
        return {
            s.name: read_engine(s.engine, s.url, _READ_TIMEOUT_S) for s in self.topology.servers
        }

    def queue_depth(self) -> float:
        """Requests waiting, summed over the servers that export it and answer."""
        return sum(r.queue or 0.0 for r in self.engine_readings().values())

    def requests_taken(self) -> dict[str, float] | None:
        """Of each server whose engine counts its finished requests and answers."""
        taken = {
            name: r.finished + (r.running or 0.0) + (r.queue or 0.0)
            for name, r in self.engine_readings().items()
            if r.finished is not None
        }
        return taken or None

    def kv_cache_usage(self) -> float | None:
        """The fullest KV cache among the servers that export it (0..1), None: none does."""
        shares = [r.kv_cache for r in self.engine_readings().values() if r.kv_cache is not None]
        return max(shares) if shares else None

    def healthy_workers(self, mode: str = "") -> int:
        return sum(
            1
            for server in self.topology.servers
            if (not mode or server.mode == mode) and answers(server, _READ_TIMEOUT_S)
        )

    def recovery_facts(self, since_ts: float) -> dict[str, Any] | None:
        return self.supervisor.recovery_facts(since_ts) if self.supervisor else None


def _gpu_pids(pid: int) -> tuple[list[int], str]:
    """The pids holding a GPU inside the process tree of `pid`, and how they were found."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        tree = set(descendants([pid]))
        listed = [int(w) for w in out.split() if w.isdigit() and int(w) in tree]
        if listed:
            return listed, "nvidia-smi"
        return [pid], "server pid (nvidia-smi lists none of its processes)"
    return [pid], "server pid (no nvidia-smi here)"


def _connect(host: str, port: int) -> str:
    """What a TCP connect meets: connected, refused, or timeout."""
    try:
        with socket.create_connection((host, port), timeout=_PROBE_CONNECT_S):
            return "connected"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return f"failed ({exc.strerror or exc})"


def _wait(check: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
