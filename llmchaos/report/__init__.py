"""What a run leaves in its folder: summary.json, journal.json, timeline.csv, the recovery
chart (recovery.png, recovery.svg) and report.html. See `write_run_report`.
"""

from __future__ import annotations

import contextlib
import csv
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaoslib.configuration import load_configuration

from llmchaos.analysis import (
    Recovery,
    SecondRecord,
    Slo,
    WindowVerdict,
    fault_impact,
    read_timeline,
    recovery,
    rolling_windows,
    tenant_latency,
)
from llmchaos.files import write_json_atomic, write_text_atomic
from llmchaos.ledger import FaultEntry
from llmchaos.redact import redact
from llmchaos.report.chart import ChartMarks, write_recovery_chart
from llmchaos.report.html import render_html
from llmchaos.report.score import run_score
from llmchaos.report.summary import RunResult, probe_output, verdict_of
from llmchaos.settings import RunSettings

__all__ = ["RunFacts", "RunResult", "write_run_report"]


@dataclass(frozen=True)
class RunFacts:
    """What the run knows at its end, handed to the report (no dependency on the run object)."""

    name: str
    title: str
    run_dir: Path
    settings: RunSettings
    qps_run: float
    faults: Sequence[FaultEntry]
    load_start_ts: float | None
    timeline_path: Path | None
    load_summary: dict[str, Any] | None
    frame_drops_since_fault: int | None
    """From the load's live window since the first fault (needs success instants the
    timeline does not keep), read before the load stopped."""
    guard: str | None
    interrupted_because: str | None
    notes: Sequence[str]
    started_at: float
    rebuilt: str | None = None
    """Set when the report is written again after the run was killed ("rebuilt after the run
    was killed at <phase>")."""
    target_recovery: dict[str, Any] | None = None
    """How the target's parts came back after the first fault (Target.recovery_facts)."""
    machine: dict[str, Any] | None = None
    """This machine's spare CPU while the load ran (llmchaos.machine.MachineCpu.to_dict)."""


def _write_csv(
    path: Path, records: Sequence[SecondRecord], windows: Sequence[WindowVerdict]
) -> None:
    by_end = {w.end_ts - 1: w for w in windows}
    classes = sorted({c for r in records for c in r.failed})
    text = io.StringIO()
    out = csv.writer(text)
    out.writerow(
        [
            *("ts", "scheduled", "ok", *(f"failed_{c}" for c in classes), "dropped"),
            *("lost_worker", "unanswered"),
            *("p50_ms", "p99_ms", "ttft_p99_ms", "itl_p99_ms", "tpot_p99_ms", "gpu", "cpu"),
            *("window_p99_ms", "window_error_rate", "window_meets_slo"),
        ]
    )
    for r in records:
        w = by_end.get(r.ts)
        out.writerow(
            [
                *(r.ts, r.scheduled, r.ok, *(r.failed.get(c, 0) for c in classes)),
                *(r.dropped, r.lost_worker, r.unanswered),
                *(_round(r.latency.quantile(0.5)), _round(r.latency.quantile(0.99))),
                *(_round(r.stream_p99_ms.get(n)) for n in ("ttft_ms", "itl_ms", "tpot_ms")),
                *(r.modes.get("gpu", 0), r.modes.get("cpu", 0)),
                *((w.p99_ms, w.error_rate, w.meets_slo) if w else ("", "", "")),
            ]
        )
    write_text_atomic(path, text.getvalue())


def _round(value: float | None) -> float | str:
    return "" if value is None else round(value, 2)


def write_run_report(facts: RunFacts, journal: dict[str, Any] | None) -> RunResult:
    """Analyse the timeline, write every file of the run folder, return the result. A FAIL
    verdict on a journal Chaos Toolkit calls completed and not deviated sets its status to
    failed (in `journal` itself: `chaos run` then exits 1)."""
    s = facts.settings
    slo = Slo(s.p99_slo_ms, s.error_rate_slo, s.error_classes)
    records: list[SecondRecord] = []
    if facts.timeline_path is not None and facts.timeline_path.exists():
        records = read_timeline(facts.timeline_path)
    windows = rolling_windows(records, slo, s.window_s)
    fault_times = [f.at for f in facts.faults]
    rec: Recovery | None = None
    impact = None
    if fault_times and records:
        last = max(fault_times)
        rec = recovery(
            records,
            last,
            slo,
            window_s=s.window_s,
            stable_for_s=s.stable_for_s,
            active_until_ts=max(f.active_until for f in facts.faults),
        )
        impact = fault_impact(
            records,
            min(fault_times),
            slo,
            window_s=s.window_s,
            # the fault's whole cost: up to the end of the stable run that confirmed recovery
            until_ts=rec.judged_until_ts if rec.recovered else None,
            in_flight_s=s.request_timeout_s,
        )
    probed = probe_output(journal, "after", "recovery_time_s")
    recovery_time = probed if isinstance(probed, int | float) else None
    source = "probe" if recovery_time is not None else None
    if recovery_time is None and rec is not None and rec.recovered:
        recovery_time, source = rec.recovery_time_s, "timeline"
    origin = facts.load_start_ts or (records[0].ts if records else facts.started_at)
    faults = [
        {
            "fault": f.fault,
            "target": f.target,
            "at": f.at,
            "at_s": round(f.at - origin, 3),
            "state": f.state,
            "details": f.details,
            "error": f.error,
            "in_effect": f.in_effect,
            "evidence": f.evidence,
        }
        for f in facts.faults
    ]
    verdict, reasons = verdict_of(journal, facts.guard, facts.interrupted_because, faults)
    if (
        journal is not None
        and verdict == "fail"
        and journal.get("status") == "completed"
        and not journal.get("deviated")
    ):
        # Chaos Toolkit calls a run completed, and exits 0, after an action that raised (the
        # fault never went in) or with a fault not in effect; the verdict is FAIL, and so are
        # the journal and the exit code
        journal["status"] = "failed"
    result = RunResult(
        experiment=facts.name,
        title=facts.title,
        run_dir=str(facts.run_dir),
        verdict=verdict,
        reasons=reasons,
        journal_status=(journal or {}).get("status"),
        deviated=bool((journal or {}).get("deviated")),
        steady_state_before_met=_met(journal, "before"),
        steady_state_after_met=_met(journal, "after"),
        target=s.target,
        variant=s.variant,
        qps_asked=s.qps,
        qps_run=facts.qps_run,
        sla_s=s.sla_s,
        recovered=None if rec is None else (rec.recovered or source == "probe"),
        recovery_time_s=recovery_time,
        recovery_time_source=source,
        detected_after_s=(
            round(rec.detected_at_ts - rec.fault_ts, 3)
            if rec is not None and rec.detected_at_ts is not None
            else None
        ),
        worst_p99_ms=impact.worst_p99_ms if impact else None,
        peak_error_rate=impact.peak_error_rate if impact else None,
        failed_requests=impact.failed_requests if impact else None,
        frame_drops=facts.frame_drops_since_fault,
        cpu_mode_s=impact.cpu_mode_s if impact else None,
        cpu_answers=impact.cpu_answers if impact else None,
        gpu_return_s=impact.gpu_return_s if impact else None,
        slo={
            "p99_ms": s.p99_slo_ms,
            "error_rate": s.error_rate_slo,
            "error_classes": list(s.error_classes),
            "queue_depth": s.queue_depth_slo,
            "window_s": s.window_s,
            "stable_for_s": s.stable_for_s,
        },
        faults=faults,
        load=facts.load_summary,
        load_start_ts=facts.load_start_ts,
        started_at=facts.started_at,
        ended_at=time.time(),
        guard=facts.guard,
        notes=list(facts.notes),
        rebuilt=facts.rebuilt,
        target_recovery=facts.target_recovery,
        machine=facts.machine,
        score=None if any(r.startswith("fault not") for r in reasons) else run_score(journal),
        tenants={
            "whole_run": tenant_latency(records),
            "since_fault": tenant_latency(records, min(fault_times)) if fault_times else {},
        }
        if records
        else None,
    )
    run_dir = facts.run_dir
    if journal is not None:
        write_json_atomic(run_dir / "journal.json", redact(journal))
    _write_csv(run_dir / "timeline.csv", records, windows)
    chart_svg = None
    if records:
        title = f"{facts.title} ({s.variant}): {verdict.upper()}"
        marks = ChartMarks(origin, fault_times, rec)
        _, chart_svg = write_recovery_chart(
            records, windows, slo, marks, run_dir / "recovery", title
        )
    result.write(run_dir / "summary.json")
    write_text_atomic(
        run_dir / "report.html", render_html(result, journal, chart_svg, _values(s, journal))
    )
    return result


def _met(journal: dict[str, Any] | None, phase: str) -> bool | None:
    state = ((journal or {}).get("steady_states") or {}).get(phase)
    return None if not state else bool(state.get("steady_state_met"))


def _values(settings: RunSettings, journal: dict[str, Any] | None) -> dict[str, Any]:
    """What `${...}` in the experiment meant in this run: its configuration (resolved the way
    Chaos Toolkit did, from the same environment), over the run's settings; secrets masked."""
    values = settings.to_dict()
    raw = ((journal or {}).get("experiment") or {}).get("configuration")
    if isinstance(raw, dict):
        with contextlib.suppress(Exception):  # a report without it is still a report
            values.update(load_configuration(raw))
    return dict(redact(values))
