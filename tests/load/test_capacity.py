"""Capacity: the knee rule, the chart, and a stepped run against a target of known capacity."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET

import pytest

from llmchaos.cli import main
from llmchaos.load.aggregate import Aggregate
from llmchaos.load.capacity import (
    CapacityResult,
    StepResult,
    find_knee,
    render_svg,
    render_table,
    step_result,
)
from llmchaos.load.timeline import Recorder


def step(qps: float, achieved: float, p99: float) -> StepResult:
    return StepResult(offered_qps=qps, achieved_qps=achieved, p99_ms=p99, error_rate=0.0, dropped=0)


def test_knee_is_flat_qps_with_rising_p99():
    steps = [step(100, 100, 20), step(200, 199, 22), step(300, 290, 30), step(400, 300, 400)]
    # 200 -> 300: QPS +46% (still growing), P99 +36%: not the knee. 300 -> 400: +3%, +1233%.
    assert find_knee(steps) == 3
    assert find_knee(steps[:3]) is None
    # Flat QPS alone (P99 steady) is not a knee either.
    assert find_knee([step(100, 100, 20), step(200, 102, 21)]) is None


def test_unanswered_requests_count_at_their_age_in_the_step_p99():
    # Second 2: 100 scheduled, 90 answered in 50 ms, 10 still hanging when read at 6.5 s.
    recorder = Recorder()
    for i in range(100):
        recorder.scheduled(2)
        recorder.launched()
        if i < 90:
            recorder.finished(2, "ok", 50.0, 2.05)
    agg = Aggregate(start_epoch_s=time.time() - 6.5, duration_s=10.0, target_qps=100.0)
    agg.add_report("w1", recorder.take_report(next_due_s=6.5))
    w = agg.window(2, 3)
    assert w["in_flight"] == 10
    assert w["latency_ms"]["p99"] == pytest.approx(50, rel=0.01)  # the answered ones only
    # At least 6.5 - 3 s old: a floor, never more than their true latency.
    assert 3400 <= w["latency_with_unanswered_ms"]["p99"] <= 3600
    assert w["latency_with_unanswered_ms"]["p50"] == pytest.approx(50, rel=0.01)


def test_chart_is_valid_svg_with_both_series_and_the_knee():
    steps = (step(100, 100, 20), step(200, 199, 22), step(300, 205, 400))
    svg = render_svg(CapacityResult(steps, 2, 199.0))
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 2
    assert "knee" in svg and "sustainable 199 QPS" in svg


@pytest.mark.slow
@pytest.mark.solo  # the target's capacity is what the machine leaves it
def test_capacity_finds_the_knee_of_a_100_qps_target(fake_server, tmp_path, capsys):
    # One request at a time, 10 ms each. Beside the other tests on 6 xdist workers the fake
    # server's capacity was the machine's, not its script's: at 500/s (2 ms each, half a core
    # of HTTP) it answered 352/s at 550 offered and the knee came a step early; at 100/s its
    # P99 passed 900 ms at 80 offered, and the queue it drained into the later steps hid the
    # knee. Alone, or with two busy loops beside it, it held 100.0/s (3 of 3).
    server = fake_server("--serial-ms", "10", "--delay-ms", "1")
    out = tmp_path / "cap"
    code = main(
        [
            "capacity",
            "--url",
            server.url,
            "--start-qps",
            "20",
            "--step-qps",
            "30",
            "--max-qps",
            "170",
            "--step-s",
            "3",
            "--stream-share",
            "0",
            "--out",
            str(out),
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert code == 0
    result = json.loads((out / "capacity.json").read_text())
    print(json.dumps(result))
    assert result["knee_reached"], result
    # 80/s is served in full; 110/s saturates the 100/s target (goodput +25%, still growing:
    # not the knee); 140/s adds no goodput while the queue grows: the knee. As the queue
    # drains into the next step, a loaded machine can put the knee one step later (it did
    # at the 500/s scale), at 170/s.
    offered = [s["offered_qps"] for s in result["steps"]]
    assert offered in ([20, 50, 80, 110, 140], [20, 50, 80, 110, 140, 170]), offered
    assert 90 <= result["sustainable_qps"] <= 112
    knee = result["steps"][result["knee_step"]]
    assert knee["offered_qps"] > result["sustainable_qps"]
    assert knee["p99_ms"] > 5 * result["steps"][0]["p99_ms"]
    assert (out / "capacity.svg").read_text().startswith("<svg")


def test_step_figures_by_class_frame_drops_and_the_knee_table():
    window = {
        "ok_completed_qps": 40.0,
        "latency_with_unanswered_ms": {"p99": 900.0},
        "error_rate": 0.2,
        "dropped": 3,
        "ok": 80,
        "failed": {"5xx": 10, "timeout": 5, "429": 4, "connection": 1, "bad_body": 0},
    }
    s = step_result(50.0, window, {"frame_drops": 2})
    assert s.error_rate_by_class == {"5xx": 0.1, "timeout": 0.05, "429": 0.04, "other": 0.01}
    assert (s.frame_drops, s.dropped, s.failed) == (
        2,
        3,
        {"5xx": 10, "timeout": 5, "429": 4, "connection": 1},
    )
    result = CapacityResult.of_steps([step(100, 100, 20), step(200, 199, 22), s])
    assert (result.knee_index, result.sustainable_qps) == (2, 199)
    table = render_table(result)
    assert "3 knee" in table and "10.0%" in table and "sustainable 199.0 QPS" in table
