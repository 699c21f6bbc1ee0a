"""`llmchaos gameday`: the nightly game day. Run the resilience suite, keep its history, build
the Allure report with trends, exit non-zero on any SLA breach.

    reports/gameday/
      history.jsonl            Allure's own history (status trends across game days)
      recovery-history.jsonl   one line per experiment run: recovery time, SLA, verdict
      <time>/allure-results/   what pytest wrote, plus one "recovery-time trend" result per
                               experiment with its chart attached
      <time>/runs/             the run folders of the experiments
      <time>/report/index.html the report (one file)
      latest -> <time>/report

Allure 3 (npm `allure`, pinned in package-lock.json, installed with `npm ci`) rather than
Allure 2: it needs Node only (no Java), writes the whole report as one HTML file that opens
from disk or CI artifacts, keeps history in one JSON-lines file, and generates in ~1 s.
"""

from __future__ import annotations

import json
import os
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
from llmchaos.report.summary import RunResult
from llmchaos.signals import held
from llmchaos.targets import DEFAULT_VARIANT, KINDS

__all__ = ["ALLURE_CATEGORIES", "SUITES", "GamedayResult", "run_gameday"]

REPO = Path(__file__).resolve().parent.parent
ALLURE_BIN = REPO / "node_modules" / ".bin" / "allure"
SUITES: dict[str, list[str]] = {
    "nightly": [],
    "smoke": ["-k", "default"],
}
"""Suite name -> extra pytest arguments: nightly = every experiment and negative control;
smoke = the experiments on the default stack only."""

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
    argv = [sys.executable, "-m", "pytest", str(REPO / "suites"), "-m", "resilience"]
    argv += ["--alluredir", str(results), "-p", "no:cacheprovider", "-q", *SUITES[suite]]
    if select:
        argv += ["-k", select]
    env = {**os.environ, "LLMCHAOS_SUITE_DIR": str(folder / "runs"), "LLMCHAOS_TARGET": target}
    print(f"game day {folder.name}: suite {suite}, target {target}", flush=True)
    code = _run_suite(argv, env)
    outcomes = _record_history(root, folder)
    for experiment in sorted({o["experiment"] for o in outcomes}):
        _add_trend_result(root, experiment, results)
    report = None
    try:
        report = _generate_report(root, folder, results)
    except AllureMissing as exc:
        print(f"llmchaos gameday: {exc}", file=sys.stderr)
    _print_summary(outcomes, report, folder)
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
                "run_dir": str(summary.parent),
            }
        )
    with (root / "recovery-history.jsonl").open("a") as f:
        for outcome in outcomes:
            f.write(json.dumps(outcome) + "\n")
    return outcomes


def _history(root: Path, experiment: str) -> list[dict[str, Any]]:
    lines = []
    path = root / "recovery-history.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if item.get("experiment") == experiment:
            lines.append(item)
    return lines


def _add_trend_result(root: Path, experiment: str, results: Path) -> None:
    """One extra Allure result per experiment: its recovery time across game days (default
    variant; known-bad variants for comparison), as a chart and a table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    ax.set_title(f"{experiment}: recovery time per game day")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    chart = results / f"{uuid.uuid4()}-attachment.svg"
    fig.savefig(chart)
    plt.close(fig)
    table = results / f"{uuid.uuid4()}-attachment.csv"
    table.write_text(
        "gameday,variant,verdict,recovery_time_s,sla_s,worst_p99_ms\n"
        + "".join(
            f"{h['gameday']},{h['variant']},{h['verdict']},{h['recovery_time_s']},"
            f"{h['sla_s']},{h['worst_p99_ms']}\n"
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
    latest = root / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink() if latest.is_symlink() else shutil.rmtree(latest)
    latest.symlink_to(index.parent.relative_to(root))
    return index


def _print_summary(outcomes: list[dict[str, Any]], report: Path | None, folder: Path) -> None:
    print(f"\ngame day {folder.name}")
    for o in outcomes:
        recovery = "not recovered" if o["recovered"] is False else f"{o['recovery_time_s']} s"
        known_bad = " (known-bad: must fail)" if o["variant"] != DEFAULT_VARIANT else ""
        print(
            f"  {o['experiment']:<24} {o['variant']:<18} {o['verdict']:<5} "
            f"recovery {recovery} (SLA {o['sla_s']:g} s){known_bad}"
        )
    print(f"report: {report or '(not generated)'}\nruns: {folder / 'runs'}", flush=True)
