"""The resilience score, as Krkn defines it ("Resiliency Scoring", krkn-chaos docs): each SLO
is worth 3 points when critical, 1 when a warning, and the score is the share of the points
kept, (total - lost) / total x 100.

An experiment's SLOs are the probes of its steady-state hypothesis, judged after the fault
(before it, when the run never got that far); Chaos Toolkit stops at the first probe that
misses, so the control judges the rest for the score (llmchaos.control). Critical: an
outage (the error rate, not recovering within the SLA); a warning: a degradation (P99, queue
depth, anything else). An experiment may say otherwise per probe in its llmchaos extension:
`"slo_severity": {"<probe name>": "critical" | "warning"}`. A game day's score pools the
points of every experiment run on the default variant (known-bad variants are meant to lose
theirs).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["SEVERITY_POINTS", "pooled_score", "run_score", "severity_of"]

SEVERITY_POINTS = {"critical": 3, "warning": 1}
"""Krkn's default weights."""

_CRITICAL_PROBES = frozenset({"recovery_time_s", "error_rate"})
"""Probe functions whose miss is an outage rather than a degradation."""


def severity_of(probe: dict[str, Any], overrides: dict[str, str]) -> str:
    """critical or warning: the experiment's own word for this probe, else by its function."""
    name = probe.get("name", "")
    if name in overrides:
        return overrides[name]
    func = (probe.get("provider") or {}).get("func", "")
    return "critical" if func in _CRITICAL_PROBES else "warning"


def _overrides(journal: dict[str, Any]) -> dict[str, str]:
    for entry in (journal.get("experiment") or {}).get("extensions") or []:
        if isinstance(entry, dict) and entry.get("name") == "llmchaos":
            given = entry.get("slo_severity") or {}
            return {k: v for k, v in given.items() if v in SEVERITY_POINTS}
    return {}


def run_score(journal: dict[str, Any] | None) -> dict[str, Any] | None:
    """{"percent", "points", "total", "slos": [{"name", "severity", "passed"}]} of one run, from
    its Chaos Toolkit journal; None when no hypothesis was judged."""
    states = (journal or {}).get("steady_states") or {}
    judged = states.get("after") or states.get("before")
    if not judged or not judged.get("probes"):
        return None
    overrides = _overrides(journal or {})
    # Chaos Toolkit stops at the first miss; the control judged the rest (llmchaos_rest)
    runs = [*judged["probes"], *(judged.get("llmchaos_rest") or [])]
    slos = [
        {
            "name": run.get("activity", {}).get("name", "?"),
            "severity": severity_of(run.get("activity", {}), overrides),
            "passed": bool(run.get("tolerance_met")) and run.get("status") != "failed",
        }
        for run in runs
    ]
    return _score(slos) | {"slos": slos}


def pooled_score(slo_lists: Iterable[list[dict[str, Any]]]) -> dict[str, Any] | None:
    """The score over the SLOs of several runs together (a game day); None when there are none."""
    slos = [slo for slos in slo_lists for slo in slos]
    return _score(slos) if slos else None


def _score(slos: list[dict[str, Any]]) -> dict[str, Any]:
    total = sum(SEVERITY_POINTS[s["severity"]] for s in slos)
    lost = sum(SEVERITY_POINTS[s["severity"]] for s in slos if not s["passed"])
    return {
        "percent": round(100.0 * (total - lost) / total, 1) if total else 100.0,
        "points": total - lost,
        "total": total,
    }
