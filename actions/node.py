"""Node faults: a node taken for maintenance (cordoned, its pods evicted)."""

from __future__ import annotations

from typing import Any

from llmchaos import faults
from llmchaos.run import current_run

__all__ = ["drain_node"]


def drain_node(node: str) -> dict[str, Any]:
    """Cordon `node` and evict the stack's pods from it, as for maintenance; a
    PodDisruptionBudget that forbids an eviction keeps its pod (listed as blocked). The node
    is uncordoned at the run's end. Targets with nodes to drain only (a cluster)."""
    return faults.drain_node(current_run(), node)
