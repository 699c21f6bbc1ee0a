"""The embedded reference stack as a live target: real processes, namespaces and Redis.

    target = EmbeddedTarget(start_stack(StackConfig(...)))   # or of a stack already up
    target.kill_gpu_process("gpu-0"); target.partition_node("node-a"); ...
    target.close()                                           # stops the stack

The topology is read again from disk for every operation: restoring a gateway changes its
pid, and the topology file is where that is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from llmchaos.errors import InvalidInput, StackError
from llmchaos.ledger import Verification
from llmchaos.processes import pid_alive, start_ticks
from llmchaos.stack import cgroups, netns, nfqueue, tc
from llmchaos.stack.agent import AgentSettings
from llmchaos.stack.config import StackConfig
from llmchaos.stack.procs import http_get_status
from llmchaos.stack.registry import MEMBERS, leader, restart_member, wait_ready
from llmchaos.stack.settings import load_settings
from llmchaos.stack.stack import (
    gateway_layout,
    node_layout,
    restart_gateway,
    stop_stack,
    use_netns,
)
from llmchaos.stack.topology import (
    RegistryInfo,
    Topology,
    read_agent_state,
    read_replicas,
    read_secrets,
)
from llmchaos.targets import Replicas, Target, TargetInfo, WorkerRef
from llmchaos.targets.cache import expire_keys, expiry_verification, key_ttls
from llmchaos.targets.embedded.gpu import GpuFaults
from llmchaos.targets.embedded.network import NetworkFaults
from llmchaos.targets.embedded.processes import ProcessFaults, pid_gone
from llmchaos.targets.embedded.resources import ResourceFaults

__all__ = ["EmbeddedTarget", "planned_info"]

_TOKEN_PATTERN = "token:*"
_READ_TIMEOUT_S = 0.5
"""Timeout of one metrics or health read: a partitioned node must not stall a probe."""
_GATEWAY_READ_TIMEOUT_S = 2.0
"""Timeout of one read of a gateway's /metrics: an overloaded gateway answers late."""


def planned_info(config: StackConfig) -> TargetInfo:
    """The names a stack started from `config` will have, known before starting it."""
    with_netns = use_netns(config)
    return TargetInfo(
        nodes=tuple(node for node, _ in node_layout(config)),
        workers=tuple(
            WorkerRef(worker, mode, node)
            for node, workers in node_layout(config)
            for worker, mode in workers
        ),
        gateways=tuple(name for name, _ in gateway_layout(config)),
        partitions_supported=with_netns,
        partitions_need="nodes as network namespaces: root, with netns auto or on",
        registry_members=tuple(f"reg-{i}" for i in range(MEMBERS))
        if config.discovery == "etcd"
        else (),
        unsupported=_unsupported(with_netns),
    )


def _unsupported(with_netns: bool) -> dict[str, str]:
    """What this machine cannot do to the embedded stack, and why (see TargetInfo)."""
    unsupported = {}
    for fault, controller in (("throttle_cpu", "cpu"), ("oom_kill_worker", "memory")):
        reason = cgroups.support(controller)
        if reason is not None:
            unsupported[fault] = reason
    if not with_netns:
        unsupported["degrade_network"] = "nodes are not network namespaces here (needs root)"
    elif (no_netem := tc.netem_support()) is not None and (no_queue := nfqueue.support()):
        # without netem a delayer takes the node's packets from an NFQUEUE (network.py)
        unsupported["degrade_network:delay_ms"] = f"{no_netem}; and {no_queue}"
    return unsupported


class EmbeddedTarget(ProcessFaults, GpuFaults, ResourceFaults, NetworkFaults, Target):
    """A running embedded stack, known by its state folder."""

    def __init__(self, topology: Topology) -> None:
        self._state_dir = Path(topology.state_dir)
        self._topology = topology
        self._token_snapshot: tuple[float, dict[bytes, int]] = (0.0, {})

    def close(self) -> None:
        """Stop the whole stack; safe to call twice."""
        stop_stack(self.topology)

    def record(self) -> dict[str, Any]:
        return {"stack_state_dir": str(self._state_dir)}

    @property
    def topology(self) -> Topology:
        """The stack as last written to disk (gateway pids change on restore)."""
        # state folder gone: keep the last one read
        with contextlib.suppress(InvalidInput):
            self._topology = Topology.load(self._state_dir)
        return self._topology

    def info(self) -> TargetInfo:
        topology = self._topology
        return TargetInfo(
            nodes=tuple(n.name for n in topology.nodes),
            workers=tuple(
                WorkerRef(w.name, w.mode, n.name) for n in topology.nodes for w in n.workers
            ),
            gateways=tuple(g.name for g in topology.gateways),
            partitions_supported=all(n.netns for n in topology.nodes),
            registry_members=tuple(m.name for m in topology.registry.members)
            if topology.registry
            else (),
            unsupported=_unsupported(all(n.netns for n in topology.nodes)),
        )

    @property
    def gateway_url(self) -> str:
        return self._topology.gateway_url

    @property
    def tokens_file(self) -> str | None:
        return self._topology.tokens_file

    # -- faults --------------------------------------------------------------------------
    def crash_gateway(self, gateway: str) -> dict[str, Any]:
        info = self._gateway(gateway)
        if not pid_alive(info.pid):
            raise StackError(f"{gateway} is not running (pid {info.pid})")
        os.kill(info.pid, signal.SIGKILL)
        return {"gateway": gateway, "pid": info.pid}

    def restore_gateway(self, gateway: str) -> None:
        restart_gateway(self.topology, self._gateway(gateway).name)

    def _gateway(self, name: str) -> Any:
        for gateway in self.topology.gateways:
            if gateway.name == name:
                return gateway
        known = ", ".join(g.name for g in self.topology.gateways)
        raise InvalidInput(f"gateway: unknown gateway {name!r}; gateways: {known}")

    # -- the registry ----------------------------------------------------------------------
    def _registry(self) -> RegistryInfo:
        registry = self.topology.registry
        if registry is None:
            raise InvalidInput("the stack has no registry (discovery etcd)")
        return registry

    def registry_leader(self) -> str:
        return leader(self._registry().members)

    def kill_registry_member(self, member: str) -> dict[str, Any]:
        info = self._registry().member(member)
        started = start_ticks(info.pid) if info.pid else None
        if started is None:
            raise StackError(f"registry member {member} is not running (pid {info.pid})")
        os.kill(info.pid, signal.SIGKILL)
        return {"member": member, "pid": info.pid, "start_ticks": started}

    def restart_registry_member(self, member: str) -> None:
        restart_member(self.topology, member)

    def wait_registry_ready(self, timeout_s: float = 30.0) -> None:
        wait_ready(self._registry().members, timeout_s)

    def _member_netns(self, member: str) -> str:
        namespace = self._registry().member(member).netns
        if not namespace:
            raise InvalidInput(
                f"registry member {member!r} is not in a network namespace: partitions need "
                "root (netns auto or on)"
            )
        return namespace

    def partition_registry_member(self, member: str) -> None:
        netns.partition_namespace(self._member_netns(member))

    def verify_kill_registry_member(self, details: dict[str, Any]) -> Verification:
        """The member's pid, seen alive at the kill, gone from /proc (only the undo starts it
        again): a pid that had exited before is gone too, but was never seen alive."""
        who, pid = f"registry member {details['member']}", int(details["pid"])
        if details.get("start_ticks") is None:
            return Verification(False, f"{who}: pid {pid} not seen alive at the kill")
        return pid_gone(who, pid)

    def verify_partition_registry_member(self, details: dict[str, Any]) -> Verification:
        """The DROP rules in the member's namespace dropping: its peers' heartbeats and the
        gateways' reads reach it all the time."""
        namespace = self._member_netns(str(details["member"]))
        return self._rules_rising(namespace, "partition", ("INPUT", "OUTPUT"))

    def heal_registry_member(self, member: str) -> None:
        namespace = self._registry().member(member).netns
        if namespace and namespace in netns.list_namespaces():
            netns.heal_partition(namespace)

    def expire_token_cache(self, ttl_s: float) -> int:
        url, password = self.topology.redis_url, read_secrets(self._state_dir).redis_password
        # each key's TTL before: the check tells a key that was deleted and cached again
        # from one that was never touched
        before = key_ttls(url, password, url, pattern=_TOKEN_PATTERN)
        self._token_snapshot = (ttl_s, before)
        return expire_keys(url, password, _TOKEN_PATTERN, ttl_s, url)

    def verify_expire_token_cache(self, details: dict[str, Any]) -> Verification:
        ttl_s, before = self._token_snapshot
        url, password = self.topology.redis_url, read_secrets(self._state_dir).redis_password
        now = key_ttls(url, password, url, keys=before) if before else {}
        return expiry_verification(ttl_s, _TOKEN_PATTERN, before, now)

    # -- readings ------------------------------------------------------------------------
    def queue_depth(self) -> float:
        """Sum of vllm:num_requests_waiting over the workers that answer (a dead worker holds
        no queue; a partitioned one is unknown and left out)."""
        stats = self.engine_stats()
        return stats["waiting"] if stats else 0.0

    def replicas(self) -> Replicas:
        """Desired from the stack's replicas file (all GPU workers without an autoscaler),
        ready by the GPU workers' /healthz, the bounds from the autoscaler's settings."""
        topology = self.topology
        gpus = [w for n in topology.nodes for w in n.workers if w.mode == "gpu"]
        ready = self.healthy_workers("gpu")
        if topology.replicas_path is None:
            return Replicas(desired=len(gpus), ready=ready)
        try:
            desired = read_replicas(Path(topology.replicas_path)).get("gpu", 0)
        except (OSError, ValueError) as exc:
            raise StackError(f"{topology.replicas_path}: {exc}") from None
        autoscaled = topology.autoscaler_pid is not None and pid_alive(topology.autoscaler_pid)
        detail = ""
        state = self._state_dir / "autoscaler-state.json"
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            last = json.loads(state.read_text())["decisions"][-1]
            detail = f"utilisation {last['utilization']}, {last['reason']}"
        return Replicas(
            desired=desired,
            ready=ready,
            min_replicas=self._autoscale_min(),
            max_replicas=len(gpus),
            autoscaled=autoscaled,
            detail=detail,
        )

    def _autoscale_min(self) -> int | None:
        try:
            return int(
                json.loads((self._state_dir / "autoscaler.json").read_text())["min_replicas"]
            )
        except (OSError, ValueError, KeyError):
            return None

    def gateway_metrics(self, names: tuple[str, ...]) -> dict[str, float]:
        """Raises StackError when no gateway answered (a busy gateway's /metrics can take
        longer than an engine's: 2 s each)."""
        read = _at_once(
            lambda g: _metrics(g.url + "/metrics", names, _GATEWAY_READ_TIMEOUT_S),
            self.topology.gateways,
        )
        answered = [r for r in read if r is not None]
        if not answered:
            raise StackError(f"no gateway answered /metrics for {', '.join(names)}")
        return {name: sum(r[name] for r in answered) for name in names}

    def engine_stats(self) -> dict[str, float] | None:
        """vLLM's metrics over the workers that answer: the fullest KV cache, preemptions so
        far and requests waiting, summed."""
        names = ("vllm:kv_cache_usage_perc", "vllm:num_preemptions_total")
        names += ("vllm:num_requests_waiting",)
        workers = [worker for node in self._topology.nodes for worker in node.workers]
        read = _at_once(lambda w: _metrics(w.url + "/metrics", names), workers)
        answered = [r for r in read if r is not None]
        if not answered:
            return None
        return {
            "kv_cache_usage_max": max(r[names[0]] for r in answered),
            "preemptions_total": sum(r[names[1]] for r in answered),
            "waiting": sum(r[names[2]] for r in answered),
        }

    def requests_taken(self) -> dict[str, float] | None:
        """Of each worker that answers (absent: it does not)."""
        names = ("vllm:request_success_total", "vllm:num_requests_running")
        names += ("vllm:num_requests_waiting",)
        workers = [worker for node in self._topology.nodes for worker in node.workers]
        read = _at_once(lambda w: _metrics(w.url + "/metrics", names), workers)
        return {
            w.name: sum(r.values()) for w, r in zip(workers, read, strict=True) if r is not None
        }

    def _agent_restart_delay_s(self) -> float:
        """How long the node agents wait before restarting a dead worker."""
        path = Path(self._state_dir) / f"agent-{self.topology.nodes[0].name}.json"
        return load_settings(AgentSettings, path).restart_delay_s

    def kv_cache_usage(self) -> float | None:
        stats = self.engine_stats()
        return stats["kv_cache_usage_max"] if stats else None

    def recovery_facts(self, since_ts: float) -> dict[str, Any] | None:
        """Each worker that died after `since_ts`, from its node agent (the kubelet here):
        rescheduling is the agent's restart delay, readiness the model load."""
        recovered, unrecovered = [], []
        for node in self.topology.nodes:
            state = read_agent_state(Path(node.agent_state_path))
            for name, worker in (state.workers if state else {}).items():
                died = worker.last_exit_at
                if died is None or died < since_ts:
                    continue
                fact: dict[str, Any] = {
                    "name": name,
                    "node": node.name,
                    "died_at": died,
                    "restarts": worker.restarts,
                    "rescheduling_time_s": round(worker.started_at - died, 3)
                    if worker.running
                    else None,
                }
                if worker.running and worker.ready_at is not None:
                    fact["readiness_time_s"] = round(worker.ready_at - worker.started_at, 3)
                    fact["total_recovery_time_s"] = round(worker.ready_at - died, 3)
                    recovered.append(fact)
                else:
                    unrecovered.append(fact)
        return {"recovered": recovered, "unrecovered": unrecovered}

    def healthy_workers(self, mode: str = "") -> int:
        workers = [
            worker
            for node in self._topology.nodes
            for worker in node.workers
            if not mode or worker.mode == mode
        ]
        statuses = _at_once(lambda w: http_get_status(w.url + "/healthz", _READ_TIMEOUT_S), workers)
        return statuses.count(200)


_Part = TypeVar("_Part")
_Reading = TypeVar("_Reading")


def _at_once(read: Callable[[_Part], _Reading], parts: Sequence[_Part]) -> list[_Reading]:
    """`read(part)` for every part at once, in their order: a reading of the fleet is one
    moment's. One after another, 32 workers' counters were read over hundreds of ms, and a
    worker that did not answer put its 0.5-s timeout between the reads of the next ones."""
    if not parts:
        return []
    with ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="llmchaos-read") as pool:
        return list(pool.map(read, parts))


def _metrics(
    url: str, names: tuple[str, ...], timeout_s: float = _READ_TIMEOUT_S
) -> dict[str, float] | None:
    """Sum of the samples of each of `names` at `url`; None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode()
    except (OSError, urllib.error.URLError):
        return None
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals
