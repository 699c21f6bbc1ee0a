"""The verdict: strict where Chaos Toolkit is lenient."""

from __future__ import annotations

from typing import Any

from llmchaos.report.summary import verdict_of


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
