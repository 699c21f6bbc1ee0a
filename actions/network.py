"""Network faults: a node cut off from everything (iptables DROP in its namespace)."""

from __future__ import annotations

from llmchaos import faults
from llmchaos.run import current_run

__all__ = ["heal_partition", "partition_node"]


def partition_node(node: str) -> str:
    """Drop every packet in and out of `node` (both directions): its workers time out rather
    than refuse, as a real partition does. Undone by heal_partition or at the run's end."""
    return faults.partition_node(current_run(), node)


def heal_partition(node: str) -> str:
    """Let `node`'s traffic through again (idempotent)."""
    return faults.heal_partition(current_run(), node)
