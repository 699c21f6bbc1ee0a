"""The resilience suite's plumbing and `llmchaos gameday`: a broken experiment is one failing
test; Allure missing is a clear message; two game days give a report whose trends show both,
checked in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, ci_run_env, signal_and_wait, stop_gracefully
from llmchaos import gameday
from llmchaos.gameday import AllureMissing
from llmchaos.report.score import pooled_score
from llmchaos.stack.cleanup import leftovers
from llmchaos.stack.procs import scan_stack_processes

BIN = Path(sys.executable).parent
CHROMIUM = Path("/usr/bin/chromium")
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")
BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def test_a_broken_experiment_is_one_failing_test(tmp_path: Path) -> None:
    experiments = tmp_path / "experiments"
    experiments.mkdir()
    (experiments / "broken.json").write_text('{"title": "half a file", ')
    good = json.loads((REPO / "experiments" / "gpu_kill.json").read_text())
    good["configuration"]["qps"] = -1
    (experiments / "bad_qps.json").write_text(json.dumps(good))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(REPO / "suites"),
            "-m",
            "resilience",
            "-q",
            "-p",
            "no:cacheprovider",
            "--alluredir",
            str(tmp_path / "allure"),
        ],
        cwd=REPO,
        env={**os.environ, "LLMCHAOS_EXPERIMENTS_DIR": str(experiments)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    # broken.json: one test; bad_qps.json: its default and its negative control
    # (the soak suite's cases are collected and deselected: `-m resilience`)
    assert re.match(r"3 failed(, \d+ deselected)? in", out.splitlines()[-1]), out[-3000:]
    assert "framework error: broken.json is not a valid experiment" in out
    assert "not JSON" in out
    assert "qps: expected a number > 0 and <= 1,000,000, got -1" in out
    assert list((tmp_path / "allure").glob("*-result.json")), "the Allure results are written"


def test_allure_missing_is_a_clear_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gameday, "ALLURE_BIN", tmp_path / "no" / "allure")
    results = tmp_path / "allure-results"
    results.mkdir()
    with pytest.raises(AllureMissing) as raised:
        gameday._generate_report(tmp_path, tmp_path, results)
    assert "run `npm ci`" in str(raised.value)
    assert str(results) in str(raised.value)


def test_a_selection_that_matches_nothing_fails_the_game_day(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            str(BIN / "llmchaos"),
            "gameday",
            "--select",
            "no_such_experiment",
            "--root",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout[-2000:]


@pytest.mark.slow
def test_two_game_days_give_a_report_with_both_in_its_trends(tmp_path: Path) -> None:
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail("CI must check the report in Debian's chromium (apt-get install chromium)")
        pytest.skip("no /usr/bin/chromium")
    root = tmp_path / "gameday"
    for _ in range(2):
        done = subprocess.run(
            [
                str(BIN / "llmchaos"),
                "gameday",
                "--select",
                "gpu_kill and default and not all and not qps",
                "--root",
                str(root),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    days = [json.loads(line) for line in (root / "recovery-history.jsonl").read_text().splitlines()]
    assert len({d["gameday"] for d in days}) == 2
    assert len((root / "history.jsonl").read_text().splitlines()) == 2
    _check_report_in_chromium(root / "latest" / "index.html", tmp_path)


def _check_report_in_chromium(front: Path, tmp_path: Path) -> None:
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    calls_out: list[str] = []  # the report must work offline and tell no one it was opened

    def new_page() -> Any:
        page = browser.new_page()
        page.on("request", lambda r: r.url.startswith(LOCAL_SCHEMES) or calls_out.append(r.url))
        return page

    # chromium's own files (~/.config/chromium, dconf's in ~/.cache) go to the test's folder
    home = tmp_path / "browser-home"
    browser_env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM), args=BROWSER_ARGS, env=browser_env
        )
        try:
            page = new_page()
            # the game day's own page first: score, recovery against the SLA, the trend
            page.goto(front.as_uri())
            page.get_by_text("Resilience score:").wait_for(timeout=10_000)
            # gpu_kill.json's SLA, or CI's shorter one for it (the game day runs the suite)
            configured = json.loads((REPO / "experiments" / "gpu_kill.json").read_text())
            sla_s = ci_run_env("gpu_kill").get(
                "LLMCHAOS_SLA_S", str(configured["configuration"]["sla_s"]["default"])
            )
            assert f"/ SLA {sla_s} s" in page.locator("table").inner_text()
            assert page.locator("svg").count() == 1
            page.get_by_text("Allure report").click()
            index = front.parent / "allure.html"
            page.wait_for_url(index.as_uri())
            # the recovery-time trend across game days, as its own result
            page.get_by_text("gameday", exact=True).first.click()
            page.get_by_text("recovery-time trend: gpu_kill").first.click()
            description = page.frame_locator("[data-testid=test-result-description-frame]")
            description.get_by_text("across 2 game day(s)").wait_for(timeout=10_000)
            history = page.get_by_test_id("test-result-tab-history")
            assert "1" in history.inner_text(), "Allure's history holds the first game day"
            _opens_an_image(page, page.get_by_text("recovery-time trend", exact=True).last)
            # the experiment itself, with its recovery chart (a fresh page: the one above
            # came from the game day's page and keeps Allure's route)
            page = new_page()
            page.goto(index.as_uri())
            for section in ("suites", "test_catalogue.py"):
                page.get_by_text(section, exact=True).first.click()
            page.get_by_text("gpu_kill on hardened (must pass)").first.click()
            _opens_an_image(page, page.get_by_text("recovery chart (SVG)").first)
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        except PlaywrightError as e:
            # what the page showed, for a failure seen only in CI
            page.screenshot(path=str(tmp_path / "failed.png"), full_page=True)
            shown = page.inner_text("body")[:2000]
            raise AssertionError(f"{e.message} on {page.url}, showing:\n{shown}") from e
        finally:
            browser.close()
    assert not calls_out, f"the report called out: {calls_out}"


def _opens_an_image(page: Any, attachment: Any) -> None:
    """Clicking the attachment's header shows one more image than before (its content)."""
    images = page.locator("img[src^='data:'], img[src^='blob:']")
    before = images.count()
    attachment.click()
    page.wait_for_function(
        "n => document.querySelectorAll(\"img[src^='data:'], img[src^='blob:']\").length > n",
        arg=before,
        timeout=10_000,
    )


@pytest.mark.slow
def test_an_interrupted_game_day_stops_its_running_experiment(tmp_path: Path) -> None:
    """SIGTERM to `llmchaos gameday` mid-experiment: pytest gets a Ctrl-C, the runner stops
    its `chaos run` (own session) cleanly, and nothing of the run is left."""
    root = tmp_path / "gameday"
    argv = [
        str(BIN / "llmchaos"),
        "gameday",
        "--select",
        "gpu_kill and default and not all and not qps",
    ]
    proc = subprocess.Popen(
        [*argv, "--root", str(root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run_file = _wait_for_file(root, "*/runs/*/*/run.json", proc)
        _wait_for_file(run_file.parent, "load/timeline.jsonl", proc)
        out, _, took_s = signal_and_wait(proc, signal.SIGTERM, 240)
    finally:
        stop_gracefully(proc)
    assert proc.returncode == 130, out[-3000:]
    assert took_s < 120, took_s
    run = json.loads(run_file.read_text())
    assert run["status"] == "finished", run
    summary = json.loads((run_file.parent / "summary.json").read_text())
    assert summary["reasons"][0].startswith("interrupted by SIGTERM"), summary["reasons"]
    stack_id = Path(run["target_record"]["stack_state_dir"]).name
    assert leftovers(stack_id).empty, leftovers(stack_id).summary()


@pytest.mark.slow
def test_the_next_case_starts_beside_one_and_a_session_ending_then_stops_it(
    tmp_path: Path,
) -> None:
    """suites.catalogue.SuiteRuns: under CI, gpu_kill's two cases each take half the machine
    (conftest.CI_EXPERIMENT_ENV), so the second case's run starts with the first; a session
    that ends then (here -x after the first case failed: its P99 SLO is 1 ms) stops the run
    started ahead and removes its folder, and neither run leaves anything behind.
    (tests/chaos/test_suite_runs.py: a run that takes the whole machine waits for the one
    before it to stop its target.)"""
    suite, stacks = tmp_path / "suite", tmp_path / "stacks"
    first = suite / "test_experiment_gpu_kill_default_hardened__"
    ahead = suite / "test_experiment_gpu_kill_negative_no-failover__"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "pytest", "suites", "-m", "resilience", "-x"),
            *("-k", "gpu_kill and not all and not qps", "-p", "no:cacheprovider"),
            *("--alluredir", str(tmp_path / "allure")),
        ],
        cwd=REPO,
        env={
            **os.environ,
            "CI": "1",
            "LLMCHAOS_SUITE_DIR": str(suite),
            "LLMCHAOS_STACKS_ROOT": str(stacks),
            "LLMCHAOS_P99_SLO_MS": "1",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stack_ids: set[str] = set()
    first_when_ahead_began: dict[str, Any] | None = None
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            stack_ids |= {p.name for p in stacks.glob("*") if p.is_dir()}
            if first_when_ahead_began is None and ahead.exists():
                run_files = list(first.glob("*/run.json"))  # none yet: not stopped either
                first_when_ahead_began = json.loads(run_files[0].read_text()) if run_files else {}
            time.sleep(0.05)
        out = proc.communicate(timeout=60)[0]
    finally:
        stop_gracefully(proc)
    assert proc.returncode == 1, out[-3000:]
    assert "1 failed" in out.splitlines()[-1], out[-3000:]
    # the run ahead was started beside the first, before its stack stopped (the session may
    # end before the second got as far as its own stack)
    assert first_when_ahead_began is not None, "no run was started ahead"
    assert not first_when_ahead_began.get("target_stopped_at"), first_when_ahead_began
    assert not ahead.exists(), "the run started ahead for a test that never came is removed"
    assert stack_ids, "the first run's stack was seen"
    for stack_id in stack_ids:
        assert leftovers(stack_id).empty, leftovers(stack_id).summary()
    ours = [
        p for p in scan_stack_processes() if p.owner and str(tmp_path) in (p.owner.run_dir or "")
    ]
    assert not ours, ours


def _wait_for_file(folder: Path, pattern: str, proc: subprocess.Popen[str]) -> Path:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the game day ended early"
        found = sorted(folder.glob(pattern))
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no {pattern} under {folder} within 180 s")


def _collected(*marker: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(REPO / "suites"), *marker, "--collect-only", "-q"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_the_soak_is_a_suite_of_its_own() -> None:
    """The soak runs for hours: never with the catalogue (`-m resilience`, `make test`), only
    as `-m soak` (`llmchaos gameday --suite soak`), with its known-bad variant."""
    from llmchaos.gameday import SUITES

    resilience, soak = _collected("-m", "resilience"), _collected("-m", "soak")
    assert resilience and not [t for t in resilience if "soak" in t]
    assert soak == [
        "suites/test_soak.py::test_soak[soak[default:hardened]]",
        "suites/test_soak.py::test_soak[soak[negative:late-degradation]]",
    ]
    assert SUITES["soak"] == ["-m", "soak"] and "resilience" in SUITES["nightly"]
    soak_file = json.loads((REPO / "experiments" / "soak" / "soak.json").read_text())
    step = soak_file["configuration"]["soak_step_s"]
    assert (step["key"], step["env_var_type"]) == ("LLMCHAOS_SOAK_STEP_S", "int")


def _outcome(day: str, experiment: str, variant: str, passed: list[bool]) -> dict[str, Any]:
    slos = [
        {"name": f"slo{i}", "severity": "critical" if i == 0 else "warning", "passed": ok}
        for i, ok in enumerate(passed)
    ]
    return {
        "gameday": day,
        "experiment": experiment,
        "variant": variant,
        "verdict": "pass" if all(passed) else "fail",
        "recovered": True,
        "recovery_time_s": 4.25,
        "sla_s": 15.0,
        "worst_p99_ms": 900.0,
        "score_percent": pooled_score([slos])["percent"],  # type: ignore[index]
        "slos": slos,
        "run_dir": f"/runs/{day}/{experiment}-{variant}",
    }


def test_the_game_day_page_opens_on_recovery_against_sla_score_and_trend(tmp_path: Path) -> None:
    day1 = [_outcome("d1", "gpu_hang", "hardened", [True, False])]
    day2 = [
        _outcome("d2", "gpu_hang", "hardened", [True, True]),
        _outcome("d2", "gpu_slow", "hardened", [False, True, True]),
        # a known-bad variant loses its points by design: not in the game day's score
        _outcome("d2", "gpu_slow", "round-robin", [False, False, False]),
    ]
    lines = [json.dumps(o) for o in day1 + day2]
    (tmp_path / "recovery-history.jsonl").write_text("\n".join(lines) + "\n")
    days = gameday._day_scores(tmp_path)
    # d1: 3 of 4 points; d2: (3 + 1) + (1 + 1) of 4 + 5 points
    assert days == {"d1": 75.0, "d2": round(100 * 6 / 9, 1)}
    results = tmp_path / "results"
    results.mkdir()
    gameday._add_score_result("d2", day2, days, results)
    (result,) = [json.loads(p.read_text()) for p in results.glob("*-result.json")]
    assert result["name"] == "resilience score: 66.7%" and result["status"] == "failed"
    assert "4.25 s / SLA 15 s" in result["descriptionHtml"]
    report = tmp_path / "report"
    report.mkdir()
    (report / "allure.html").write_text("<html></html>")
    page = gameday._write_front_page(report / "allure.html", "d2", day2, days).read_text()
    body = page[page.index("<body>") :]
    # the first things on it: the score, then each run's recovery against its SLA, the trend
    assert body.index("Resilience score: <b>66.7%</b>") < body.index("4.25 s / SLA 15 s")
    assert body.index("4.25 s / SLA 15 s") < body.index("<svg")
    assert "round-robin (known-bad)" in body and "caught (failed)" in body
    assert "slo0 (critical)" in body  # the SLO that lost gpu_slow its points
    assert 'href="allure.html"' in body
