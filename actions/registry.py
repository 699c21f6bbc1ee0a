"""Service-registry faults: the etcd cluster the gateways find their workers in."""

from __future__ import annotations

from typing import Any

from llmchaos import faults
from llmchaos.run import current_run

__all__ = ["kill_registry_member", "partition_registry_member", "restore_registry"]


def kill_registry_member(member: str = "leader") -> list[dict[str, Any]]:
    """SIGKILL registry members: "leader" (the one leading when the action runs), "all", or
    a member's name (reg-0, ...). They are started again at the run's end. Returns one record
    per member: {"member", "pid"}."""
    return faults.kill_registry_member(current_run(), member)


def partition_registry_member(member: str = "all") -> list[str]:
    """Cut registry members off from their peers and clients (iptables DROP in their
    namespaces): "leader", "all" or a name. Healed at the run's end. Returns the names."""
    return faults.partition_registry_member(current_run(), member)


def restore_registry(member: str = "all") -> list[str]:
    """Heal and restart registry members ("all" or a name); idempotent."""
    return faults.restore_registry(current_run(), member)
