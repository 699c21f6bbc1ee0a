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


def _tolerance(tolerance: Any, values: dict[str, Any]) -> str:
    """A probe tolerance as `at_most(limit=10)`, `${...}` read from the run's settings (Chaos
    Toolkit writes the probe's output into the tolerance as `value`: left out)."""
    if not (isinstance(tolerance, dict) and tolerance.get("type") == "probe"):
        return json.dumps(tolerance)
    provider = tolerance.get("provider", {})
    arguments = []
    for name, value in provider.get("arguments", {}).items():
        if name == "value":
            continue
        if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
            value = values.get(value[2:-1], value)
        arguments.append(f"{name}={value}")
    return f"{provider.get('func', tolerance.get('name'))}({', '.join(arguments)})"


def _probe_rows(journal: dict[str, Any] | None, values: dict[str, Any]) -> str:
    rows = []
    for phase in ("before", "after"):
        state = ((journal or {}).get("steady_states") or {}).get(phase) or {}
        for run in state.get("probes", []):
            activity = run.get("activity", {})
            tolerance = _tolerance(activity.get("tolerance"), values)
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


_LATENCIES = (
    ("latency_ms", "end to end"),
    ("ttft_ms", "TTFT (first non-empty content chunk)"),
    ("itl_ms", "ITL (gap between content chunks)"),
    ("tpot_ms", "TPOT ((e2e - TTFT) / (tokens - 1))"),
)


def _load_table(load: dict[str, Any] | None) -> str:
    """The load's own figures: rates over the time it ran, latency quantiles in ms."""
    if not load:
        return "<p class=muted>no load summary</p>"
    quantiles = ("p50", "p90", "p99", "p999")
    head = "<tr><th>ms, from the scheduled send</th>" + "".join(
        f"<th>{q}</th>" for q in ("p50", "p90", "p99", "p99.9")
    )
    rows = "".join(
        f"<tr><th>{html.escape(title)}</th>"
        + "".join(f"<td>{_cell((load.get(name) or {}).get(q))}</td>" for q in quantiles)
        + "</tr>"
        for name, title in _LATENCIES
    )
    goodput = load.get("goodput_qps")
    rates = (
        f"achieved {_cell(load.get('achieved_qps'))} QPS, goodput {_cell(goodput)} QPS, "
        f"{_cell(load.get('output_tokens_per_s'))} output tokens/s over the "
        f"{_cell(load.get('ran_s'))} s the load ran"
    )
    return f"<p>{html.escape(rates)}</p><table>{head}</tr>{rows}</table>"


_IN_EFFECT = {True: "yes", False: '<span class="badge fail">NO</span>', None: "not checked"}
"""How the faults table says whether the check after the injection saw the fault in effect."""


def _cell(value: Any) -> str:
    return (
        "-"
        if value is None
        else html.escape(f"{value:g}" if isinstance(value, float) else str(value))
    )


def _recovery_table(facts: dict[str, Any] | None) -> str:
    """The target's parts that died after the fault and how they came back (Krkn's terms)."""
    if not facts or not (facts.get("recovered") or facts.get("unrecovered")):
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(str(part['name']))}</td><td>{html.escape(str(part['node']))}</td>"
        f"<td>{state}</td>"
        + "".join(
            f"<td>{'-' if part.get(key) is None else f'{part[key]:.1f} s'}</td>"
            for key in ("rescheduling_time_s", "readiness_time_s", "total_recovery_time_s")
        )
        + "</tr>"
        for state in ("recovered", "unrecovered")
        for part in facts.get(state, [])
    )
    return (
        "<h2>Target recovery</h2><p class=muted>The target's own account (Krkn's pod recovery "
        "times): rescheduling = death until restarted, readiness = restarted until ready.</p>"
        "<table><tr><th>part</th><th>node</th><th>state</th><th>rescheduling</th>"
        f"<th>readiness</th><th>total</th></tr>{rows}</table>"
    )


def _tenant_table(tenants: dict[str, Any] | None) -> str:
    """Each tenant's P50/P99 over the whole run and since the fault (jitter attribution)."""
    whole = (tenants or {}).get("whole_run") or {}
    if not whole:
        return ""
    since = (tenants or {}).get("since_fault") or {}
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{v['requests']}</td>"
        f"<td>{_cell(v['p50_ms'])}</td><td>{_cell(v['p99_ms'])}</td>"
        f"<td>{_cell((since.get(name) or {}).get('requests'))}</td>"
        f"<td>{_cell((since.get(name) or {}).get('p99_ms'))}</td></tr>"
        for name, v in whole.items()
    )
    return (
        "<h2>Tenants</h2><p class=muted>End-to-end latency by tenant (ms, from the scheduled "
        "send time): whose requests the fault hurt.</p><table><tr><th>tenant</th>"
        "<th>requests</th><th>p50</th><th>p99</th><th>requests since fault</th>"
        f"<th>p99 since fault</th></tr>{rows}</table>"
    )


def render_html(
    result: RunResult,
    journal: dict[str, Any] | None,
    chart_svg: Path | None,
    settings: dict[str, Any],
) -> str:
    """The page; `chart_svg` is embedded by relative file name (it sits beside the page);
    `settings` (the run's, as a dict) resolves `${...}` in tolerances."""
    r = result
    figures = "".join(
        _row(name, value)
        for name, value in (
            *r.figures(),
            ("experiment asked", f"{r.qps_asked:g} QPS"),
            ("recovery time from", r.recovery_time_source or "-"),
            ("journal status", f"{r.journal_status}, deviated: {r.deviated}"),
        )
    )
    faults = "".join(
        f"<tr><td>{f['at_s']:.1f} s</td><td>{html.escape(f['fault'])}</td>"
        f"<td>{html.escape(f['target'])}</td><td>{html.escape(f['state'])}</td>"
        f"<td>{_IN_EFFECT[f.get('in_effect')]}</td>"
        f"<td>{html.escape(f.get('evidence') or '-')}</td></tr>"
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
            *(("recovery.png",) if chart_svg else ()),
        )
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(r.title)} - llmchaos</title>
<style>{_STYLE}</style></head><body>
<h1>{html.escape(r.title)} <span class="badge {r.verdict}">{r.verdict.upper()}</span></h1>
<p class=muted>{html.escape(r.experiment)} · {html.escape(r.run_dir)}</p>
{f"<p><strong>Report {html.escape(r.rebuilt)}.</strong></p>" if r.rebuilt else ""}
{f"<ul>{reasons}</ul>" if reasons else ""}
<table>{figures}</table>
{chart}
<h2>Load</h2>
{_load_table(r.load)}
<h2>Faults</h2>
<table><tr><th>at</th><th>fault</th><th>target</th><th>state</th><th>in effect</th>
<th>evidence</th></tr>{faults}</table>
{_recovery_table(r.target_recovery)}
{_tenant_table(r.tenants)}
<h2>Steady-state probes</h2>
{_probe_rows(journal, settings)}
{f"<h2>Notes</h2><ul>{notes}</ul>" if notes else ""}
<p>{files}</p>
</body></html>
"""
