"""Faults of a chaos run: what the actions do. Each is written to the ledger before it acts.

Selectors are checked against the target's names before anything is touched (InvalidInput
names the argument and the known values). A fault with an undo gets one ledger entry per
thing it hits, so a half-done action is undone exactly as far as it went.
"""

from __future__ import annotations

from typing import Any

from llmchaos.errors import InvalidInput
from llmchaos.ledger import Undo
from llmchaos.run import ChaosRun
from llmchaos.settings import argument_ranges

__all__ = [
    "crash_gateway",
    "drain_node",
    "expire_token_cache",
    "heal_partition",
    "inject_burst",
    "kill_gpu_process",
    "kill_registry_member",
    "partition_node",
    "partition_registry_member",
    "registry_members",
    "restore_gateway",
    "restore_registry",
    "set_qps",
]


def kill_gpu_process(run: ChaosRun, worker: str = "", node: str = "") -> list[dict[str, Any]]:
    """SIGKILL the process holding the GPU of `worker` ("*" = every GPU worker) or of every
    GPU worker on `node`. Nothing to undo: the node agent (kubelet) restarts it. Returns
    [{"worker", "pid", ...}]."""
    names = run.target.info().gpu_workers(worker, node)
    killed = []
    with run.fault("kill_gpu_process", ",".join(names), None) as details:
        for name in names:
            killed.append(run.target.kill_gpu_process(name))
            details["killed"] = killed
    return killed


def partition_node(run: ChaosRun, node: str) -> str:
    """Drop every packet in and out of `node` until heal_partition (or the run's end)."""
    info = run.target.info()
    real = info.node_name(node)
    if not info.partitions_supported:
        raise InvalidInput(f"partition_node: needs {info.partitions_need}")
    with run.fault("partition_node", real, Undo("heal_partition", {"node": real})):
        run.target.partition_node(real)
    return real


def heal_partition(run: ChaosRun, node: str) -> str:
    """Let `node`'s traffic through again (idempotent)."""
    real = run.target.info().node_name(node)
    run.target.heal_partition(real)
    run.ledger.close_matching(Undo("heal_partition", {"node": real}), by="heal_partition")
    return real


def drain_node(run: ChaosRun, node: str) -> dict[str, Any]:
    """Cordon `node` and evict the stack's pods from it (a node taken for maintenance); it
    is uncordoned at the run's end, unless it was cordoned before the fault."""
    info = run.target.info()
    real = info.node_name(node)
    if not info.drains_supported:
        raise InvalidInput(f"drain_node: the {run.settings.target} target has no nodes to drain")
    undo = Undo("uncordon_node", {"node": real})
    with run.fault("drain_node", real, undo) as details:
        details.update(run.target.drain_node(real))
    if details.get("was_unschedulable"):
        run.ledger.close_matching(undo, by="nobody: it was cordoned before the fault")
    return dict(details)


def crash_gateway(run: ChaosRun, gateway: str = "primary") -> list[str]:
    """Kill gateway processes at once (SIGKILL): "primary", "all" or a gateway name. They stay
    down until restore_gateway (or the run's end). Returns the names."""
    names = run.target.info().gateway_names(gateway)
    for name in names:
        with run.fault("crash_gateway", name, Undo("restore_gateway", {"gateway": name})) as d:
            d.update(run.target.crash_gateway(name))
    return names


def restore_gateway(run: ChaosRun, gateway: str = "all") -> list[str]:
    """Start crashed gateways again and wait for them (idempotent)."""
    names = run.target.info().gateway_names(gateway)
    for name in names:
        undo = Undo("restore_gateway", {"gateway": name})
        run.target.restore_gateway(name)
        run.ledger.close_matching(undo, by="restore_gateway")
    return names


def expire_token_cache(run: ChaosRun, ttl_s: float = 0.0) -> int:
    """Delete every cached token (ttl_s = 0), or make them all expire in `ttl_s` seconds (the
    synchronized expiry of a fixed TTL after a mass token refresh). Nothing to undo: the
    cache refills. Returns the number of keys touched."""
    ttl_s = argument_ranges(run.settings)["ttl_s"].check("ttl_s", ttl_s)
    with run.fault("expire_token_cache", "token:*", None) as details:
        details["keys"] = run.target.expire_token_cache(ttl_s)
    return int(details["keys"])


def set_qps(run: ChaosRun, qps: float) -> float:
    """Change the load's total rate from now on; undone (back to the previous rate) at the
    run's end. Returns the previous rate."""
    qps = argument_ranges(run.settings)["qps"].check("qps", qps)
    cap = run.max_qps()
    if cap is not None and qps > cap:
        run.notes.append(f"set_qps: {qps:g} asked, {cap:g} sent (the target's cap)")
        qps = cap
    previous = run.current_qps
    with run.fault(
        "set_qps", f"load {previous:g}->{qps:g} QPS", Undo("set_qps", {"qps": previous})
    ):
        run.traffic.set_qps(qps)
        run.current_qps = qps
    return previous


def inject_burst(run: ChaosRun, duration_s: float = 10.0, factor: float = 1.0) -> float:
    """One burst starting now: `factor` x the base rate on top for `duration_s` (ends by
    itself). Returns the extra QPS at the start."""
    ranges = argument_ranges(run.settings)
    duration_s = ranges["duration_s"].check("duration_s", duration_s)
    factor = ranges["factor"].check("factor", factor)
    with run.fault("inject_burst", f"load x{1 + factor:g} for {duration_s:g} s", None):
        run.traffic.inject_burst(duration_s=duration_s, factor=factor)
    return run.current_qps * factor


def registry_members(run: ChaosRun, member: str) -> list[str]:
    """The registry members `member` names: "leader" (the one leading now, asked of the
    registry), "all", or a member's name. Raises InvalidInput without a registry."""
    info = run.target.info()
    if member == "leader":
        info.registry_member_names("all")  # there is a registry at all
        return [run.target.registry_leader()]
    return info.registry_member_names(member)


def kill_registry_member(run: ChaosRun, member: str = "leader") -> list[dict[str, Any]]:
    """SIGKILL registry members ("leader", "all" or a name); each is started again from its
    data at the run's end (or by restore_registry). Returns [{"member", "pid"}]."""
    killed = []
    for name in registry_members(run, member):
        undo = Undo("restart_registry_member", {"member": name})
        with run.fault("kill_registry_member", name, undo) as details:
            details.update(run.target.kill_registry_member(name))
        killed.append(dict(details))
    return killed


def partition_registry_member(run: ChaosRun, member: str = "all") -> list[str]:
    """Drop every packet in and out of registry members ("leader", "all" or a name), peers
    and clients alike, until restore_registry (or the run's end). Returns the names."""
    names = registry_members(run, member)
    for name in names:
        undo = Undo("heal_registry_member", {"member": name})
        with run.fault("partition_registry_member", name, undo):
            run.target.partition_registry_member(name)
    return names


def restore_registry(run: ChaosRun, member: str = "all") -> list[str]:
    """Heal and restart registry members (idempotent); closes their faults."""
    names = run.target.info().registry_member_names(member)
    for name in names:
        run.target.heal_registry_member(name)
        run.ledger.close_matching(
            Undo("heal_registry_member", {"member": name}), by="restore_registry"
        )
    for name in names:
        run.target.restart_registry_member(name)
        run.ledger.close_matching(
            Undo("restart_registry_member", {"member": name}), by="restore_registry"
        )
    run.target.wait_registry_ready()
    return names
