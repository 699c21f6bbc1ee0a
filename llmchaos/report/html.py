"""The one-page HTML report of a run: verdict, figures, chart, faults, probes, files."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from llmchaos.report.summary import RunResult

__all__ = ["render_html"]

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1000px;color:#222}
h1{font-size:1.4em} .pass{background:#2ca02c} .fail{background:#d62728}
.badge{color:#fff;padding:.2em .6em;border-radius:4px;font-weight:bold}
table{border-collapse:collapse;margin:1em 0} td,th{border:1px solid #ccc;padding:.3em .7em;
text-align:left;vertical-align:top} th{background:#f4f4f4} img{max-width:100%}
.muted{color:#666}
"""


def _row(name: str, value: Any) -> str:
    return f"<tr><th>{html.escape(name)}</th><td>{html.escape(str(value))}</td></tr>"


def _probe_rows(journal: dict[str, Any] | None) -> str:
    rows = []
    for phase in ("before", "after"):
        state = ((journal or {}).get("steady_states") or {}).get(phase) or {}
        for run in state.get("probes", []):
            activity = run.get("activity", {})
            tolerance = activity.get("tolerance")
            if isinstance(tolerance, dict) and tolerance.get("type") == "probe":
                arguments = tolerance.get("provider", {}).get("arguments", {})
                tolerance = f"{tolerance.get('name', 'probe')} {json.dumps(arguments)}"
            met = run.get("tolerance_met")
            error = (run.get("exception") or [""])[-1].strip()
            rows.append(
                "<tr>"
                + "".join(
                    f"<td>{html.escape(str(v))}</td>"
                    for v in (
                        phase,
                        activity.get("name"),
                        error or run.get("output"),
                        tolerance,
                        "yes" if met else "NO",
                    )
                )
                + "</tr>"
            )
    if not rows:
        return "<p class=muted>no steady-state probe ran</p>"
    head = "<tr><th>phase</th><th>probe</th><th>output</th><th>tolerance</th><th>met</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def render_html(result: RunResult, journal: dict[str, Any] | None, chart_svg: Path | None) -> str:
    """The page; `chart_svg` is embedded by relative file name (it sits beside the page)."""
    r = result
    figures = "".join(
        _row(name, value)
        for name, value in (
            ("target", f"{r.target} / variant {r.variant}"),
            ("load", f"{r.qps_run:g} QPS (experiment asked {r.qps_asked:g})"),
            (
                "recovery time",
                "not recovered"
                if r.recovered is False
                else f"{r.recovery_time_s} s (SLA {r.sla_s:g} s, from {r.recovery_time_source})",
            ),
            ("detected after", f"{r.detected_after_s} s"),
            ("worst P99", f"{r.worst_p99_ms} ms (SLO {r.slo['p99_ms']:g} ms)"),
            ("peak error rate", f"{r.peak_error_rate} (SLO {r.slo['error_rate']})"),
            ("failed requests during the fault", r.failed_requests),
            ("frame drops (>= 3 s without a success)", r.frame_drops),
            ("seconds in CPU mode / CPU answers", f"{r.cpu_mode_s} / {r.cpu_answers}"),
            ("back on GPU after", f"{r.gpu_return_s} s"),
            ("journal status", f"{r.journal_status}, deviated: {r.deviated}"),
        )
    )
    faults = "".join(
        f"<tr><td>{f['at_s']:.1f} s</td><td>{html.escape(f['fault'])}</td>"
        f"<td>{html.escape(f['target'])}</td><td>{html.escape(f['state'])}</td></tr>"
        for f in r.faults
    )
    reasons = "".join(f"<li>{html.escape(reason)}</li>" for reason in r.reasons)
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in r.notes)
    chart = f'<img src="{html.escape(chart_svg.name)}" alt="recovery chart">' if chart_svg else ""
    files = " · ".join(
        f'<a href="{name}">{name}</a>'
        for name in (
            "summary.json",
            "journal.json",
            "timeline.csv",
            "load/timeline.jsonl",
            "ledger.jsonl",
            "recovery.png",
        )
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(r.title)} - llmchaos</title>
<style>{_STYLE}</style></head><body>
<h1>{html.escape(r.title)} <span class="badge {r.verdict}">{r.verdict.upper()}</span></h1>
<p class=muted>{html.escape(r.experiment)} · {html.escape(r.run_dir)}</p>
{f"<ul>{reasons}</ul>" if reasons else ""}
<table>{figures}</table>
{chart}
<h2>Faults</h2>
<table><tr><th>at</th><th>fault</th><th>target</th><th>state</th></tr>{faults}</table>
<h2>Steady-state probes</h2>
{_probe_rows(journal)}
{f"<h2>Notes</h2><ul>{notes}</ul>" if notes else ""}
<p>{files}</p>
</body></html>
"""
