"""Tolerances that read the experiment's configuration.

Chaos Toolkit does not substitute `${...}` inside range tolerances, but it does in the
arguments of a probe tolerance, so an SLA can come from configuration (and `--var`). Chaos
Toolkit passes the probe's output as `value`; it has a default only because `chaos validate`
requires every argument without one to be given:

    "tolerance": {"type": "probe", "name": "within-sla",
                  "provider": {"type": "python", "module": "probes.tolerances",
                               "func": "at_most", "arguments": {"limit": "${sla_s}"}}}
"""

from __future__ import annotations

__all__ = ["at_least", "at_most"]


def at_most(value: float | None = None, limit: float = 0.0) -> bool:
    """True when the probe's output is a number <= `limit`."""
    number = _number(value)
    return number is not None and number <= float(limit)


def at_least(value: float | None = None, limit: float = 0.0) -> bool:
    """True when the probe's output is a number >= `limit`."""
    number = _number(value)
    return number is not None and number >= float(limit)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
