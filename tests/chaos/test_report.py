"""The verdict: strict where Chaos Toolkit is lenient."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from llmchaos.errors import InvalidInput
from llmchaos.report.score import pooled_score, run_score
from llmchaos.report.summary import verdict_of
from llmchaos.validation import experiment_meta


def _journal(**overrides: Any) -> dict[str, Any]:
    probe = {"activity": {"name": "p99"}, "status": "succeeded", "tolerance_met": True}
    journal = {
        "status": "completed",
        "deviated": False,
        "steady_states": {
            "before": {"steady_state_met": True, "probes": [probe]},
            "after": {"steady_state_met": True, "probes": [probe]},
        },
        "run": [{"activity": {"name": "kill-gpu-0-process"}, "status": "succeeded"}],
    }
    journal.update(overrides)
    return journal


def test_a_clean_journal_passes() -> None:
    assert verdict_of(_journal(), None) == ("pass", [])


def test_a_fault_that_failed_to_go_in_fails_though_the_journal_completed() -> None:
    failed = {
        "activity": {"name": "kill-gpu-0-process"},
        "status": "failed",
        "exception": [
            "chaoslib.exceptions.ActivityFailed: llmchaos.errors.StackError: gpu-0: "
            "cannot read /gpu/processes\n"
        ],
    }
    verdict, reasons = verdict_of(_journal(run=[failed]), None)
    assert verdict == "fail"
    assert reasons == [
        "fault not injected: kill-gpu-0-process failed: gpu-0: cannot read /gpu/processes"
    ]


def test_unmet_before_state_guard_and_interruption_each_fail() -> None:
    before = {
        "steady_state_met": False,
        "probes": [
            {
                "activity": {"name": "p99"},
                "status": "succeeded",
                "tolerance_met": False,
                "output": 9,
            }
        ],
    }
    journal = _journal(steady_states={"before": before})
    assert verdict_of(journal, None)[1] == [
        "steady state not met before the method: p99 = 9 is out of tolerance"
    ]
    assert verdict_of(_journal(), "error rate above 50%")[1] == [
        "safety guard: error rate above 50%"
    ]
    assert verdict_of(_journal(status="interrupted"), None, "interrupted by SIGINT")[1] == [
        "interrupted by SIGINT"
    ]
    assert verdict_of(None, None)[0] == "fail"


def test_the_report_shows_the_load_s_stream_timings_and_rates(tmp_path: Path) -> None:
    from llmchaos.load.aggregate import Aggregate
    from llmchaos.load.timeline import Recorder, merge_report
    from llmchaos.report import RunFacts, write_run_report
    from llmchaos.settings import RunSettings

    agg = Aggregate(start_epoch_s=1_000_000.0, duration_s=2.0, target_qps=2.0, goodput=True)
    rec = Recorder()
    for sec in (0, 1):
        rec.scheduled(sec)
        rec.launched()
        rec.finished(
            sec, "ok", 500.0, sec + 0.5, ttft_ms=120.0, itl_ms=[20.0, 30.0], tpot_ms=25.0,
            output_tokens=3, good=True, mode="gpu",
        )  # fmt: skip
    merge_report(agg.seconds, agg.ok_slots, rec.take_report(None, final=True))
    timeline = tmp_path / "timeline.jsonl"
    lines = [agg.line(s, agg.seconds[s]) for s in (0, 1)]
    lines[1] |= {"scheduled": lines[1]["scheduled"] + 3, "lost_worker": 3}  # a worker lost
    timeline.write_text("".join(json.dumps(line) + "\n" for line in lines))
    facts = RunFacts(
        name="x", title="X", run_dir=tmp_path, settings=RunSettings(), qps_run=2.0, faults=[],
        load_start_ts=1_000_000.0, timeline_path=timeline, load_summary=agg.summary(),
        frame_drops_since_fault=None, guard=None, interrupted_because=None, notes=[],
        started_at=1_000_000.0,
    )  # fmt: skip
    write_run_report(facts, None)
    rows = list(csv.DictReader((tmp_path / "timeline.csv").open()))
    assert [r["ttft_p99_ms"] for r in rows] == ["120.0", "120.0"]
    # every scheduled request is in one column: the accounting closes row by row
    for row in rows:
        counted = ("ok", "dropped", "lost_worker", "unanswered")
        failed = sum(int(v) for k, v in row.items() if k.startswith("failed_"))
        assert int(row["scheduled"]) == sum(int(row[k]) for k in counted) + failed, row
    assert [r["lost_worker"] for r in rows] == ["0", "3"]
    assert rows[0]["tpot_p99_ms"] and rows[0]["itl_p99_ms"]
    page = (tmp_path / "report.html").read_text()
    assert "TPOT ((e2e - TTFT) / (tokens - 1))" in page and "goodput 1 QPS" in page
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["load"]["goodput_qps"] == 1.0 and summary["load"]["itl_ms"]["p50"]


def _probe(name: str, func: str, passed: bool) -> dict[str, Any]:
    activity = {"name": name, "provider": {"type": "python", "func": func}}
    return {"activity": activity, "status": "succeeded", "tolerance_met": passed}


def test_the_resilience_score_is_krkn_s_weighted_share_of_slos() -> None:
    # Krkn's formula by hand: 5 critical SLOs (3 points) and 5 warnings (1); 1 critical and
    # 2 warnings fail: (20 - 5) / 20 = 75%
    probes = [_probe(f"c{i}", "error_rate", i > 0) for i in range(5)]
    probes += [_probe(f"w{i}", "p99_latency_ms", i > 1) for i in range(5)]
    journal = _journal(steady_states={"after": {"steady_state_met": False, "probes": probes}})
    score = run_score(journal)
    assert score is not None
    assert (score["percent"], score["points"], score["total"]) == (75.0, 15, 20)
    # the experiment's own word for a probe; recovery within the SLA is critical by default
    journal["experiment"] = {
        "extensions": [{"name": "llmchaos", "slo_severity": {"w0": "critical", "w1": "critical"}}]
    }
    assert run_score(journal)["percent"] == round(100 * (24 - 9) / 24, 1)  # type: ignore[index]
    recovery = _probe("recovered", "recovery_time_s", False)
    only = _journal(steady_states={"before": {"steady_state_met": False, "probes": [recovery]}})
    assert run_score(only)["slos"] == [  # type: ignore[index]
        {"name": "recovered", "severity": "critical", "passed": False}
    ]
    assert run_score(_journal(steady_states={})) is None
    # a game day pools the points of its runs
    assert pooled_score([run_score(journal)["slos"], run_score(only)["slos"]]) == {  # type: ignore[index]
        "percent": round(100 * 15 / 27, 1),
        "points": 15,
        "total": 27,
    }


def test_a_bad_slo_severity_is_an_error_naming_the_field() -> None:
    experiment = {"extensions": [{"name": "llmchaos", "slo_severity": {"p99": "fatal"}}]}
    with pytest.raises(InvalidInput, match=r"extensions\.llmchaos\.slo_severity"):
        experiment_meta(experiment)
