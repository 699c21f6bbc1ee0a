"""API gateway faults."""

from __future__ import annotations

from llmchaos import faults
from llmchaos.run import current_run

__all__ = ["crash_gateway", "restore_gateway"]


def crash_gateway(gateway: str = "primary") -> list[str]:
    """Kill gateway processes at once (SIGKILL): "primary", "all", or a gateway name. They
    stay down until restore_gateway or the run's end. Returns their names."""
    return faults.crash_gateway(current_run(), gateway)


def restore_gateway(gateway: str = "all") -> list[str]:
    """Start crashed gateways again and wait until they answer (idempotent)."""
    return faults.restore_gateway(current_run(), gateway)
