"""Network faults: a node cut off (both ways or one), a degraded link (latency, jitter, loss,
bandwidth: Chaos Mesh NetworkChaos's delay, loss and bandwidth actions)."""

from __future__ import annotations

from typing import Any

from llmchaos import faults
from llmchaos.run import current_run

__all__ = ["degrade_network", "heal_partition", "partition_node", "restore_network"]


def partition_node(node: str, direction: str = "both") -> str:
    """Drop every packet in and out of `node` (direction "both"), or only into it ("ingress")
    or only out of it ("egress": requests arrive, answers never leave, a partial partition):
    its workers time out rather than refuse, as in a real partition. Undone by heal_partition
    or at the run's end."""
    return faults.partition_node(current_run(), node, direction)


def heal_partition(node: str) -> str:
    """Let `node`'s traffic through again (idempotent)."""
    return faults.heal_partition(current_run(), node)


def degrade_network(
    node: str,
    delay_ms: float = 0.0,
    jitter_ms: float = 0.0,
    loss_percent: float = 0.0,
    rate_kbit: float = 0.0,
    direction: str = "egress",
) -> dict[str, Any]:
    """Degrade `node`'s link: `delay_ms` +- `jitter_ms` of latency (tc netem), random loss of
    `loss_percent` of the packets, a bandwidth cap of `rate_kbit` (tc tbf); "egress" (what
    the node sends, the default), "ingress" or "both". Until restore_network or the run's
    end."""
    return faults.degrade_network(
        current_run(), node, delay_ms, jitter_ms, loss_percent, rate_kbit, direction
    )


def restore_network(node: str) -> str:
    """Lift degrade_network on `node` (idempotent)."""
    return faults.restore_network(current_run(), node)
