"""Capacity: the knee rule, the chart, and a stepped run against a target of known capacity."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from llmchaos.cli import main
from llmchaos.load.capacity import CapacityResult, StepResult, find_knee, render_svg


def step(qps: float, achieved: float, p99: float) -> StepResult:
    return StepResult(offered_qps=qps, achieved_qps=achieved, p99_ms=p99, error_rate=0.0, dropped=0)


def test_knee_is_flat_qps_with_rising_p99():
    steps = [step(100, 100, 20), step(200, 199, 22), step(300, 290, 30), step(400, 300, 400)]
    # 200 -> 300: QPS +46% (still growing), P99 +36%: not the knee. 300 -> 400: +3%, +1233%.
    assert find_knee(steps) == 3
    assert find_knee(steps[:3]) is None
    # Flat QPS alone (P99 steady) is not a knee either.
    assert find_knee([step(100, 100, 20), step(200, 102, 21)]) is None


def test_chart_is_valid_svg_with_both_series_and_the_knee():
    steps = (step(100, 100, 20), step(200, 199, 22), step(300, 205, 400))
    svg = render_svg(CapacityResult(steps, 2, 199.0))
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 2
    assert "knee" in svg and "sustainable 199 QPS" in svg


@pytest.mark.slow
def test_capacity_finds_the_knee_of_a_500_qps_target(fake_server, tmp_path, capsys):
    server = fake_server("--serial-ms", "2", "--delay-ms", "1")  # one at a time
    out = tmp_path / "cap"
    code = main(
        [
            "capacity",
            "--url",
            server.url,
            "--start-qps",
            "100",
            "--step-qps",
            "150",
            "--max-qps",
            "850",
            "--step-s",
            "2.5",
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
    # At most 500/s; asyncio's sleep overhead makes it ~370/s on this machine.
    assert 300 <= result["sustainable_qps"] <= 520
    knee = result["steps"][result["knee_step"]]
    assert knee["offered_qps"] > result["sustainable_qps"]
    assert knee["p99_ms"] > 5 * result["steps"][0]["p99_ms"]
    assert (out / "capacity.svg").read_text().startswith("<svg")
