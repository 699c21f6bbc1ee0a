"""`llmchaos gameday`: the nightly game day. Run the resilience suite, keep its history, build
the Allure report with trends, exit non-zero on any SLA breach.

    reports/gameday/
      history.jsonl            Allure's own history (status trends across game days)
      recovery-history.jsonl   one line per experiment run: recovery time, SLA, verdict
      <time>/allure-results/   what pytest wrote, plus one "recovery-time trend" result per
                               experiment with its chart attached
      <time>/runs/             the run folders of the experiments
      <time>/report/index.html the game day at a glance: each experiment's recovery time
                               against its SLA and its resilience score, the game day's score
                               and its trend across game days
      <time>/report/allure.html Allure's report (one file), linked from index.html
      latest -> <time>/report

The resilience score is Krkn's (llmchaos.report.score): critical SLOs 3 points, warnings 1,
the share of points kept; the game day's pools the experiments run on the default variant.

Allure 3 (npm `allure`, pinned in package-lock.json, installed with `npm ci`) rather than
Allure 2: it needs Node only (no Java), writes the whole report as one HTML file that opens
from disk or CI artifacts, keeps history in one JSON-lines file, and generates in ~1 s.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmchaos.errors import InvalidInput, LLMChaosError
from llmchaos.plotting import pyplot
from llmchaos.report.score import pooled_score
from llmchaos.report.summary import RunResult
from llmchaos.signals import held
from llmchaos.targets import DEFAULT_VARIANT, KINDS

__all__ = ["ALLURE_CATEGORIES", "SUITES", "GamedayResult", "run_gameday"]

REPO = Path(__file__).resolve().parent.parent
ALLURE_BIN = REPO / "node_modules" / ".bin" / "allure"
SUITES: dict[str, list[str]] = {
    "nightly": ["-m", "resilience"],
    "smoke": ["-m", "resilience", "-k", "default"],
    "soak": ["-m", "soak"],
}
"""Suite name -> pytest arguments: nightly = every experiment of the catalogue and its
negative controls; smoke = the catalogue on the default stack only; soak = the soak
experiments (experiments/soak/: hours; LLMCHAOS_SOAK_STEP_S compresses them) and their
negative controls, frame drops counted over each whole run."""

_ALLURE_ANALYTICS = re.compile(
    r'<script async src="https://www\.googletagmanager\.com/[^"]*"></script>\s*'
    r"<script>[^<]*gtag\([^<]*</script>\s*"
)
"""Google Analytics, which Allure 3's report loads unconditionally (no option turns it off):
a game day's report must not call out, and on a machine without internet its pending lookup
held up the report's page in headless Chromium."""

ALLURE_CATEGORIES = [
    {
        "name": "SLO breached",
        "matchedStatuses": ["failed"],
        "messageRegex": "SLO breached[\\s\\S]*",
    },
    {
        "name": "negative control passed (probes that cannot fail)",
        "matchedStatuses": ["failed"],
        "messageRegex": "negative control passed[\\s\\S]*",
    },
    {
        "name": "fault not in effect (the run tested nothing)",
        "matchedStatuses": ["failed"],
        "messageRegex": "fault not in effect[\\s\\S]*",
    },
    {
        "name": "target unavailable",
        "matchedStatuses": ["failed", "broken"],
        "messageRegex": "target unavailable[\\s\\S]*",
    },
    {"name": "framework error", "matchedStatuses": ["failed", "broken"]},
]
"""How the report sorts failures: the suite's messages start with their category."""


class AllureMissing(LLMChaosError):
    """The Allure CLI is not installed (the pytest results are still there)."""


@dataclass(frozen=True)
class GamedayResult:
    """What one game day produced."""

    folder: Path
    pytest_exit_code: int
    report: Path | None
    outcomes: list[dict[str, Any]]

    @property
    def exit_code(self) -> int:
        """0 only when every test passed (no SLA breach) and the report was built."""
        if self.pytest_exit_code == 5:
            return 2  # nothing collected: a selection that matches nothing is not a pass
        return 0 if self.pytest_exit_code == 0 and self.report is not None else 1


def run_gameday(
    suite: str = "nightly",
    *,
    target: str = "embedded",
    select: str | None = None,
    root: Path = Path("reports/gameday"),
) -> GamedayResult:
    """Run the suite, record history, generate the report. Raises InvalidInput for an
    unknown suite or target; Allure missing is reported in the result (report None)."""
    if suite not in SUITES:
        raise InvalidInput(f"--suite: unknown suite {suite!r}; expected one of {', '.join(SUITES)}")
    if target not in KINDS:
        raise InvalidInput(f"--target: expected one of {', '.join(KINDS)}, got {target!r}")
    root = root.resolve()
    folder = root / time.strftime("%Y%m%d-%H%M%S")
    results = folder / "allure-results"
    results.mkdir(parents=True)
    argv = [sys.executable, "-m", "pytest", str(REPO / "suites"), *SUITES[suite]]
    argv += ["--alluredir", str(results), "-p", "no:cacheprovider", "-q"]
    if select:
        argv += ["-k", select]
    env = {**os.environ, "LLMCHAOS_SUITE_DIR": str(folder / "runs"), "LLMCHAOS_TARGET": target}
    print(f"game day {folder.name}: suite {suite}, target {target}", flush=True)
    code = _run_suite(argv, env)
    outcomes = _record_history(root, folder)
    for experiment in sorted({o["experiment"] for o in outcomes}):
        _add_trend_result(root, experiment, results)
    days = _day_scores(root)
    _add_score_result(folder.name, outcomes, days, results)
    report = None
    try:
        report = _generate_report(root, folder, results)
    except AllureMissing as exc:
        print(f"llmchaos gameday: {exc}", file=sys.stderr)
    else:
        report = _write_front_page(report, folder.name, outcomes, days)
    _print_summary(outcomes, report, folder, days)
    return GamedayResult(folder, code, report, outcomes)


_SUITE_STOP_S = 300.0
"""How long an interrupted suite may take to stop its running experiment (each undoes its
faults, stops its load, writes its report and stops its stack)."""


def _run_suite(argv: list[str], env: dict[str, str]) -> int:
    """pytest over the suites; an interrupt of the game day becomes a Ctrl-C of pytest (which
    stops the running `chaos run` cleanly), waited for, then raised again."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        with held("stopping the suite"):
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=_SUITE_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise


def _record_history(root: Path, folder: Path) -> list[dict[str, Any]]:
    """Append this game day's runs to recovery-history.jsonl; returns them."""
    outcomes = []
    for summary in sorted((folder / "runs").glob("*/*/summary.json")):
        try:
            result = RunResult.read(summary)
        except (OSError, ValueError, TypeError):
            continue
        outcomes.append(
            {
                "gameday": folder.name,
                "at": result.started_at,
                "experiment": result.experiment,
                "variant": result.variant,
                "verdict": result.verdict,
                "recovered": result.recovered,
                "recovery_time_s": result.recovery_time_s,
                "sla_s": result.sla_s,
                "worst_p99_ms": result.worst_p99_ms,
                "score_percent": result.score["percent"] if result.score else None,
                "slos": result.score["slos"] if result.score else None,
                "run_dir": str(summary.parent),
            }
        )
    with (root / "recovery-history.jsonl").open("a") as f:
        for outcome in outcomes:
            f.write(json.dumps(outcome) + "\n")
    return outcomes


def _history(root: Path, experiment: str | None = None) -> list[dict[str, Any]]:
    """The lines of recovery-history.jsonl, of one experiment or all."""
    lines = []
    path = root / "recovery-history.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if experiment is None or item.get("experiment") == experiment:
            lines.append(item)
    return lines


def _day_scores(root: Path) -> dict[str, float | None]:
    """Each game day's resilience score (percent), oldest first: the SLOs of its runs on the
    default variant pooled (None: none was scored)."""
    by_day: dict[str, list[list[dict[str, Any]]]] = {}
    for h in _history(root):
        slos = by_day.setdefault(h["gameday"], [])
        if h["variant"] == DEFAULT_VARIANT and h.get("slos"):
            slos.append(h["slos"])
    scores = {day: pooled_score(slos) for day, slos in sorted(by_day.items())}
    return {day: score["percent"] if score else None for day, score in scores.items()}


def _score_chart(days: dict[str, float | None], path: Path) -> Path:
    """The game days' scores as an SVG line chart (an unscored day: a gap)."""
    plt = pyplot()

    names = list(days)
    fig, ax = plt.subplots(figsize=(8, 2.8))
    ys = [float("nan") if v is None else v for v in days.values()]
    ax.plot(range(len(names)), ys, marker="o", color="#2ca02c")
    ax.set_ylim(0, 105)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
    ax.set_ylabel("resilience score (%)")
    ax.set_title("resilience score per game day (Krkn: critical SLO 3 points, warning 1)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _add_trend_result(root: Path, experiment: str, results: Path) -> None:
    """One extra Allure result per experiment: its recovery time and resilience score across
    game days (default variant; known-bad variants for comparison), as a chart and a table."""
    plt = pyplot()

    history = _history(root, experiment)
    days = sorted({h["gameday"] for h in history})
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for variant in sorted({h["variant"] for h in history}):
        points = [h for h in history if h["variant"] == variant]
        xs = [days.index(h["gameday"]) for h in points]
        # not recovered: a gap in the line (the table says so)
        ys = [
            float("nan") if h["recovery_time_s"] is None else h["recovery_time_s"] for h in points
        ]
        ax.plot(xs, ys, marker="o", label=variant)
    sla = [h["sla_s"] for h in history]
    if sla:
        ax.axhline(sla[-1], color="#d62728", ls=":", label=f"SLA {sla[-1]:g} s")
    ax.set_xticks(range(len(days)), days, rotation=20, fontsize=7)
    ax.set_ylabel("recovery time (s)")
    ax.set_title(f"{experiment}: recovery time and resilience score per game day")
    scored = [h for h in history if h["variant"] == DEFAULT_VARIANT]
    right = ax.twinx()
    right.plot(
        [days.index(h["gameday"]) for h in scored],
        [float("nan") if h.get("score_percent") is None else h["score_percent"] for h in scored],
        color="#2ca02c",
        ls="--",
        marker="s",
        label=f"score ({DEFAULT_VARIANT})",
    )
    right.set_ylim(0, 105)
    right.set_ylabel("resilience score (%)")
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    chart = results / f"{uuid.uuid4()}-attachment.svg"
    fig.savefig(chart)
    plt.close(fig)
    table = results / f"{uuid.uuid4()}-attachment.csv"
    table.write_text(
        "gameday,variant,verdict,recovery_time_s,sla_s,worst_p99_ms,score_percent\n"
        + "".join(
            f"{h['gameday']},{h['variant']},{h['verdict']},{h['recovery_time_s']},"
            f"{h['sla_s']},{h['worst_p99_ms']},{h.get('score_percent')}\n"
            for h in history
        )
    )
    now_ms = int(time.time() * 1000)
    result = {
        "uuid": str(uuid.uuid4()),
        "historyId": f"recovery-trend-{experiment}",
        "testCaseId": f"recovery-trend-{experiment}",
        "fullName": f"gameday.recovery_trend.{experiment}",
        "name": f"recovery-time trend: {experiment}",
        "status": "passed",
        "stage": "finished",
        "start": now_ms,
        "stop": now_ms,
        "description": f"Recovery time of {experiment} across {len(days)} game day(s).",
        "labels": [
            {"name": "feature", "value": "recovery-time trend"},
            {"name": "story", "value": experiment},
            {"name": "parentSuite", "value": "gameday"},
        ],
        "attachments": [
            {"name": "recovery-time trend", "source": chart.name, "type": "image/svg+xml"},
            {"name": "recovery-time history", "source": table.name, "type": "text/csv"},
        ],
    }
    (results / f"{result['uuid']}-result.json").write_text(json.dumps(result))


def _generate_report(root: Path, folder: Path, results: Path) -> Path:
    if not ALLURE_BIN.exists():
        raise AllureMissing(
            f"Allure is not installed ({ALLURE_BIN} is missing): run `npm ci` in {REPO} "
            f"(Node 20); the pytest results are in {results}"
        )
    config = folder / "allurerc.json"
    config.write_text(
        json.dumps(
            {
                "name": "llmchaos game day",
                "output": str(folder / "report"),
                "historyPath": str(root / "history.jsonl"),
                "categories": ALLURE_CATEGORIES,
                "plugins": {
                    "awesome": {"options": {"singleFile": True, "reportName": "llmchaos game day"}}
                },
            },
            indent=2,
        )
    )
    argv = [str(ALLURE_BIN), "generate", str(results), "--config", str(config)]
    argv += ["--output", str(folder / "report")]
    done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=300)
    index = folder / "report" / "index.html"
    if done.returncode != 0 or not index.exists():
        raise AllureMissing(
            f"allure generate failed ({done.returncode}): {done.stderr[-1000:]}; the pytest "
            f"results are in {results}"
        )
    report = index.read_text()
    index.write_text(_ALLURE_ANALYTICS.sub("", report, count=1))
    allure = index.replace(index.parent / "allure.html")  # index.html: the game day's own page
    latest = root / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink() if latest.is_symlink() else shutil.rmtree(latest)
    latest.symlink_to(index.parent.relative_to(root))
    return allure


def _add_score_result(
    day: str, outcomes: list[dict[str, Any]], days: dict[str, float | None], results: Path
) -> None:
    """One Allure result for the game day: its resilience score, each experiment's beside
    it, and the score's trend across game days (failed when points were lost)."""
    score = days.get(day)
    chart = _score_chart(days, results / f"{uuid.uuid4()}-attachment.svg")
    now_ms = int(time.time() * 1000)
    lost = score is not None and score < 100.0
    result = {
        "uuid": str(uuid.uuid4()),
        "historyId": "resilience-score",
        "testCaseId": "resilience-score",
        "fullName": "gameday.resilience_score",
        "name": f"resilience score: {_percent(score)}",
        "status": "failed" if lost else "passed",
        "statusDetails": {"message": f"SLO breached: resilience score {_percent(score)}"}
        if lost
        else {},
        "stage": "finished",
        "start": now_ms,
        "stop": now_ms,
        "descriptionHtml": _outcome_table(outcomes, score, link_runs=False),
        "labels": [
            {"name": "feature", "value": "resilience score"},
            {"name": "parentSuite", "value": "gameday"},
        ],
        "attachments": [
            {"name": "resilience-score trend", "source": chart.name, "type": "image/svg+xml"}
        ],
    }
    (results / f"{result['uuid']}-result.json").write_text(json.dumps(result))


def _percent(score: float | None) -> str:
    return "not scored" if score is None else f"{score:g}%"


def _outcome_table(
    outcomes: list[dict[str, Any]], score: float | None, *, link_runs: bool, base: Path = REPO
) -> str:
    """The game day as HTML: its score, then one row per run: recovery time against the
    SLA, verdict, score and the SLOs that lost points."""
    rows = []
    for o in sorted(outcomes, key=lambda o: (o["variant"] != DEFAULT_VARIANT, o["experiment"])):
        known_bad = o["variant"] != DEFAULT_VARIANT
        if o["recovered"] is False:
            recovery = "not recovered"
        elif o["recovery_time_s"] is None:
            recovery = "-"
        else:
            recovery = f"{o['recovery_time_s']:.3g} s"
        within = o["recovery_time_s"] is not None and o["recovery_time_s"] <= o["sla_s"]
        lost = [f"{s['name']} ({s['severity']})" for s in o.get("slos") or [] if not s["passed"]]
        if known_bad:
            verdict = "caught (failed)" if o["verdict"] == "fail" else "NOT caught (passed)"
        else:
            verdict = o["verdict"]
        name = html.escape(o["experiment"])
        if link_runs:
            href = os.path.relpath(Path(o["run_dir"]) / "report.html", base)
            name = f'<a href="{html.escape(href)}">{name}</a>'
        rows.append(
            f"<tr class={'known-bad' if known_bad else 'default'}><td>{name}</td>"
            f"<td>{html.escape(o['variant'])}{' (known-bad)' if known_bad else ''}</td>"
            f"<td>{verdict}</td>"
            f"<td class={'ok' if within else 'miss'}>{recovery} / SLA {o['sla_s']:g} s</td>"
            f"<td>{_percent(o.get('score_percent'))}</td>"
            f"<td>{html.escape(', '.join(lost)) or '-'}</td></tr>"
        )
    return (
        f"<p class=score>Resilience score: <b>{_percent(score)}</b> (Krkn's: critical SLOs "
        "3 points, warnings 1; the runs on the default variant pooled)</p>"
        "<table><tr><th>experiment</th><th>variant</th><th>verdict</th>"
        "<th>recovery time / SLA</th><th>score</th><th>SLOs that lost points</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _write_front_page(
    allure: Path, day: str, outcomes: list[dict[str, Any]], days: dict[str, float | None]
) -> Path:
    """report/index.html: the game day at a glance (see the module docstring), one file."""
    chart = _score_chart(days, allure.parent / "score-trend.svg").read_text()
    chart = chart[chart.index("<svg") :]  # inline, without its XML prologue
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>llmchaos game day {html.escape(day)}</title><style>
body {{ font-family: sans-serif; margin: 2em; }} table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: left; }}
td.miss {{ color: #b00; }} tr.known-bad {{ color: #555; }} .score {{ font-size: 1.4em; }}
</style></head><body>
<h1>llmchaos game day {html.escape(day)}</h1>
{_outcome_table(outcomes, days.get(day), link_runs=True, base=allure.parent)}
<h2>Trend</h2>{chart}
<p><a href="allure.html">Allure report</a>: every test, its history, each experiment's
recovery-time trend</p></body></html>
"""
    index = allure.parent / "index.html"
    index.write_text(page)
    return index


def _print_summary(
    outcomes: list[dict[str, Any]],
    report: Path | None,
    folder: Path,
    days: dict[str, float | None],
) -> None:
    trend = " -> ".join(_percent(v) for v in list(days.values())[-5:])
    print(f"\ngame day {folder.name}: resilience score {_percent(days.get(folder.name))}")
    print(f"  trend (last game days): {trend}")
    for o in outcomes:
        recovery = "not recovered" if o["recovered"] is False else f"{o['recovery_time_s']} s"
        known_bad = " (known-bad: must fail)" if o["variant"] != DEFAULT_VARIANT else ""
        print(
            f"  {o['experiment']:<24} {o['variant']:<18} {o['verdict']:<5} "
            f"recovery {recovery} (SLA {o['sla_s']:g} s), score "
            f"{_percent(o.get('score_percent'))}{known_bad}"
        )
    print(f"report: {report or '(not generated)'}\nruns: {folder / 'runs'}", flush=True)
