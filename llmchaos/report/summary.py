"""The verdict of a run and its figures: `RunResult`, as written to `summary.json`.

The verdict follows Chaos Toolkit's own outcome, made strict: a run passes only when the
journal is `completed`, did not deviate, met the steady state *before* the method (Chaos
Toolkit skips the method and exits 0 otherwise), every activity of the method succeeded (a
fault that failed to go in proves nothing, and Chaos Toolkit still says `completed`), every
fault was seen in effect after it went in ("fault not in effect: <evidence>" otherwise: a
fault that silently did nothing proves nothing either), and the safety guard did not abort
it.
The figures come from the load's timeline (post-run analysis), except the recovery time,
which is the recovery probe's output when the experiment has one (what the tolerance judged).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmchaos.files import write_json_atomic
from llmchaos.machine import MachineCpu
from llmchaos.redact import redact

__all__ = ["RunResult", "hypothesis_outcome", "probe_output", "verdict_of"]

_EXCEPTION_PREFIX = re.compile(r"^(?:(?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*: )+")
"""Dotted exception names Chaos Toolkit puts before a probe's error message."""


@dataclass
class RunResult:
    """Everything summary.json holds; times are epoch seconds unless `_s` says a duration."""

    experiment: str
    title: str
    run_dir: str
    verdict: str
    """pass or fail."""
    reasons: list[str]
    """Why it failed (empty when it passed)."""
    journal_status: str | None
    deviated: bool
    steady_state_before_met: bool | None
    steady_state_after_met: bool | None
    target: str
    variant: str
    qps_asked: float
    qps_run: float
    sla_s: float
    recovered: bool | None
    """None when there was no fault to recover from."""
    recovery_time_s: float | None
    recovery_time_source: str | None
    """probe (the experiment's recovery_time_s probe) or timeline (post-run analysis)."""
    detected_after_s: float | None
    worst_p99_ms: float | None
    peak_error_rate: float | None
    failed_requests: int | None
    frame_drops: int | None
    cpu_mode_s: int | None
    cpu_answers: int | None
    gpu_return_s: float | None
    slo: dict[str, Any]
    faults: list[dict[str, Any]]
    load: dict[str, Any] | None
    """The load's own summary (scheduled, ok, failed by class, dropped, latency ...)."""
    load_start_ts: float | None
    started_at: float
    ended_at: float
    guard: str | None = None
    """Why the safety guard aborted the run, if it did."""
    notes: list[str] = field(default_factory=list)
    rebuilt: str | None = None
    """"rebuilt after the run was killed at <phase>" when `llmchaos cleanup` wrote this
    report from the run folder, after the run itself could not."""
    tenants: dict[str, Any] | None = None
    """Per-tenant latency (seed: jitter attributed by tenant): {"whole_run": {tenant:
    {"requests", "p50_ms", "p99_ms"}}, "since_fault": {...}} from the load's timeline."""
    target_recovery: dict[str, Any] | None = None
    """The target's own account of the recovery, in Krkn's terms: {"recovered": [{"name",
    "node", "rescheduling_time_s", "readiness_time_s", "total_recovery_time_s"}],
    "unrecovered": [...]} for each part that died after the first fault."""
    machine: dict[str, Any] | None = None
    """This machine's spare CPU while the load ran: {"cores", "span_s", "idle_cores",
    "steal_cores"} (llmchaos.machine); None when no load ran or the report was rebuilt."""
    score: dict[str, Any] | None = None
    """The resilience score (llmchaos.report.score, Krkn's): {"percent", "points", "total",
    "slos": [{"name", "severity", "passed"}]}; None when no SLO was judged or a fault did not
    go in or take effect (the run tested nothing)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write(self, path: Path) -> Path:
        return write_json_atomic(path, redact(self.to_dict()))

    @classmethod
    def read(cls, path: Path) -> RunResult:
        data = json.loads(Path(path).read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def figures(self) -> list[tuple[str, str]]:
        """The key figures, formatted, for the terminal table and the HTML page."""
        recovery = (
            "not recovered"
            if self.recovered is False
            else _fmt(self.recovery_time_s, " s") + f" (SLA {self.sla_s:g} s)"
        )
        error_rate = "-" if self.peak_error_rate is None else f"{self.peak_error_rate:.1%}"
        return [
            ("target", f"{self.target} / {self.variant}, {self.qps_run:g} QPS"),
            ("recovery time", recovery),
            ("detected after", _fmt(self.detected_after_s, " s")),
            ("worst p99", _fmt(self.worst_p99_ms, " ms") + f" (SLO {self.slo['p99_ms']:g} ms)"),
            ("peak error rate", f"{error_rate} (SLO {self.slo['error_rate']:.1%})"),
            ("failed requests", _fmt(self.failed_requests)),
            ("frame drops", _fmt(self.frame_drops)),
            ("CPU mode", _fmt(self.cpu_mode_s, " s") + f", {_fmt(self.cpu_answers)} CPU answers"),
            ("back on GPU after", _fmt(self.gpu_return_s, " s")),
            ("worst tenant p99", self._worst_tenant()),
            ("resilience score", self.score_line()),
            ("machine CPU", self.machine_line()),
        ]

    def machine_line(self) -> str:
        """ "0.32 of 2 cores idle, 0.01 stolen by the hypervisor, over 48 s", or "-"."""
        return MachineCpu(**self.machine).describe() if self.machine else "-"

    def score_line(self) -> str:
        """ "83% (5 of 6 points; lost: p99-latency-within-slo (warning))", or why unscored."""
        if self.score is None:
            return "- (not scored: no SLO judged, or the fault did not take effect)"
        lost = [f"{s['name']} ({s['severity']})" for s in self.score["slos"] if not s["passed"]]
        return (
            f"{self.score['percent']:g}% ({self.score['points']} of {self.score['total']} points"
            + (f"; lost: {', '.join(lost)})" if lost else ")")
        )

    def _worst_tenant(self) -> str:
        """The tenant with the highest P99 since the fault (the whole run when no fault)."""
        by_tenant = (self.tenants or {}).get("since_fault") or (self.tenants or {}).get("whole_run")
        ranked = [(v["p99_ms"], t) for t, v in (by_tenant or {}).items() if v["p99_ms"]]
        if not ranked:
            return "-"
        p99_ms, tenant = max(ranked)
        spread = min(p for p, _ in ranked)
        return f"{p99_ms:.0f} ms ({tenant}; best tenant {spread:.0f} ms)"

    def table(self) -> str:
        """A short plain-text table for the terminal."""
        rows = [
            *([("report", self.rebuilt)] if self.rebuilt else []),
            ("verdict", self.verdict.upper() + "".join(": " + r for r in self.reasons[:1])),
            ("experiment", f"{self.title} [{self.experiment}]"),
            *self.figures(),
            ("run folder", self.run_dir),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{unit}" if abs(value) < 1000 else f"{value:.0f}{unit}"
    return f"{value}{unit}"


def probe_output(journal: dict[str, Any] | None, phase: str, func: str) -> Any:
    """Output of the steady-state probe calling `func` in phase before/after, or None."""
    state = ((journal or {}).get("steady_states") or {}).get(phase) or {}
    for run in state.get("probes", []):
        if run.get("activity", {}).get("provider", {}).get("func") == func:
            return run.get("output")
    return None


def hypothesis_outcome(journal: dict[str, Any] | None, phase: str) -> tuple[bool | None, str]:
    """(met, a line naming the first probe that missed) of the before/after hypothesis."""
    state = ((journal or {}).get("steady_states") or {}).get(phase)
    if not state:
        return None, ""
    if state.get("steady_state_met"):
        return True, ""
    for run in state.get("probes", []):
        if not run.get("tolerance_met", True) or run.get("status") == "failed":
            name = run.get("activity", {}).get("name", "?")
            if run.get("status") == "failed":
                error = (run.get("exception") or ["failed"])[-1].strip()
                # "chaoslib.exceptions.ActivityFailed: llmchaos.measure.NotRecovered: ..."
                return False, f"{name}: {_EXCEPTION_PREFIX.sub('', error)}"
            return False, f"{name} = {run.get('output')!r} is out of tolerance"
    return False, "steady state not met"


def verdict_of(
    journal: dict[str, Any] | None,
    guard: str | None,
    interrupted_because: str | None = None,
    faults: list[dict[str, Any]] | None = None,
) -> tuple[str, list[str]]:
    """pass/fail and the reasons; see the module docstring. `faults` as summary.json lists
    them (with "in_effect" and "evidence" from the ledger)."""
    reasons = [interrupted_because] if interrupted_because else []
    for fault in faults or []:
        if fault.get("in_effect") is False:
            reasons.append(
                f"fault not in effect: {fault['fault']}({fault['target']}): {fault['evidence']}"
            )
    if journal is None:
        reasons.append("the experiment did not run to its end (no journal)")
    else:
        before, why_before = hypothesis_outcome(journal, "before")
        if before is False:
            reasons.append(f"steady state not met before the method: {why_before}")
        after, why_after = hypothesis_outcome(journal, "after")
        if journal.get("deviated") or after is False:
            reasons.append(f"deviated after the method: {why_after}")
        for activity_run in journal.get("run") or []:
            if activity_run.get("status") == "failed":
                name = activity_run.get("activity", {}).get("name", "?")
                error = (activity_run.get("exception") or ["failed"])[-1].strip()
                reasons.append(
                    f"fault not injected: {name} failed: {_EXCEPTION_PREFIX.sub('', error)}"
                )
        status = journal.get("status")
        if status != "completed" and not reasons and not guard:
            reasons.append(f"journal status {status}")
    if guard:
        reasons.append(f"safety guard: {guard}")
    return ("fail" if reasons else "pass"), reasons
