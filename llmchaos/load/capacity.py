"""`llmchaos capacity`: stepped load until the knee, the sustainable QPS, and a chart.

The knee (the field's rule): the first step where achieved QPS grows by less than 5% over the
previous step while P99 grows by more than 20%. The sustainable QPS is the achieved QPS of the
step before it. Each step is read from the live window of its own scheduled seconds, skipping
the first `warmup_share` of the step, a few seconds after the step ends (so slow requests of the
step are in), and the run stops as soon as the knee is found. Achieved QPS is by completion
time; P99 by scheduled time (so queueing shows up in the step that caused it), with requests
still unanswered when the step is read counted at their age so far: answered requests alone
would cap the P99 of every saturated step at about the step's length, and two saturated steps
in a row would then look flat (no knee) however long the queue grew.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmchaos.load.api import LoadRun
from llmchaos.load.config import LoadConfig
from llmchaos.load.profiles import stepped_stages

__all__ = [
    "REPORTED_CLASSES",
    "CapacityResult",
    "StepResult",
    "find_knee",
    "render_svg",
    "render_table",
    "run_capacity",
    "step_result",
    "write_chart",
]

SETTLE_S = 3.0
"""Wait after a step's end before reading it: answers of its last requests arrive late."""
REPORTED_CLASSES = ("5xx", "timeout", "429")
"""Failure classes a step reports one by one (the seed's 503, timeout and 429: the load counts
every 5xx together, and the embedded stack's are 503s); the rest (connection, bad body, other
4xx) as `other`."""


@dataclass(frozen=True)
class StepResult:
    offered_qps: float
    achieved_qps: float
    """Successful answers per second completed during the step (by completion time: a
    saturated target's queue does not count as throughput)."""
    p99_ms: float | None
    """P99 latency from scheduled time, unanswered requests counted at their age so far."""
    error_rate: float
    """Failed share of the step's answered requests (every failure class)."""
    dropped: int
    ok: int = 0
    """Successful answers of the requests scheduled in the step's read window."""
    failed: Mapping[str, int] = field(default_factory=dict)
    """Failed answers by the load's failure class (5xx, 429, timeout, connection, ...)."""
    frame_drops: int = 0
    """Gaps of 3 s or more without a successful answer during the whole step."""

    @property
    def error_rate_by_class(self) -> dict[str, float]:
        """Failed share of the answered requests by class: 5xx, timeout, 429, other."""
        answered = self.ok + sum(self.failed.values())
        counts = {c: self.failed.get(c, 0) for c in REPORTED_CLASSES}
        counts["other"] = sum(n for c, n in self.failed.items() if c not in REPORTED_CLASSES)
        return {c: round(n / answered, 5) if answered else 0.0 for c, n in counts.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "offered_qps": self.offered_qps,
            "achieved_qps": self.achieved_qps,
            "p99_ms": self.p99_ms,
            "error_rate": self.error_rate,
            "error_rate_by_class": self.error_rate_by_class,
            "ok": self.ok,
            "failed": dict(self.failed),
            "dropped": self.dropped,
            "frame_drops": self.frame_drops,
        }


def step_result(
    offered_qps: float, window: Mapping[str, Any], whole_step: Mapping[str, Any]
) -> StepResult:
    """One step's figures from two of the load's windows: `window` (the step after its
    warm-up: rates, P99, errors) and `whole_step` (its frame drops, counted from its start)."""
    return StepResult(
        offered_qps=offered_qps,
        achieved_qps=window["ok_completed_qps"],
        p99_ms=window["latency_with_unanswered_ms"]["p99"],
        error_rate=window["error_rate"],
        dropped=window["dropped"],
        ok=window["ok"],
        failed={c: n for c, n in window["failed"].items() if n},
        frame_drops=whole_step["frame_drops"],
    )


@dataclass(frozen=True)
class CapacityResult:
    steps: tuple[StepResult, ...]
    knee_index: int | None
    """Index of the knee step in `steps`, None when the knee was not reached."""
    sustainable_qps: float

    @classmethod
    def of_steps(cls, steps: list[StepResult]) -> CapacityResult:
        """The knee of `steps` and the sustainable QPS: the achieved QPS of the step before the
        knee, or of the last step when there is no knee."""
        knee = find_knee(steps)
        sustainable = steps[knee - 1].achieved_qps if knee is not None else steps[-1].achieved_qps
        return cls(tuple(steps), knee, sustainable)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sustainable_qps": self.sustainable_qps,
            "knee_step": self.knee_index,
            "knee_reached": self.knee_index is not None,
            "steps": [s.to_dict() for s in self.steps],
        }


def find_knee(
    steps: list[StepResult], qps_growth_max: float = 0.05, p99_growth_min: float = 0.20
) -> int | None:
    """Index of the first step where QPS grows < 5% while P99 grows > 20%, else None."""
    for i in range(1, len(steps)):
        prev, cur = steps[i - 1], steps[i]
        if not prev.achieved_qps or prev.p99_ms is None or cur.p99_ms is None or not prev.p99_ms:
            continue
        qps_growth = (cur.achieved_qps - prev.achieved_qps) / prev.achieved_qps
        p99_growth = (cur.p99_ms - prev.p99_ms) / prev.p99_ms
        if qps_growth < qps_growth_max and p99_growth > p99_growth_min:
            return i
    return None


def run_capacity(config: LoadConfig, warmup_share: float = 0.3) -> CapacityResult:
    """Run the stepped profile of `config` and stop at the knee. Raises InvalidInput early."""
    config = replace(config, profile="stepped", duration_s=None)
    stages = stepped_stages(
        config.step_start_qps, config.step_increment_qps, config.step_max_qps, config.step_s
    )
    steps: list[StepResult] = []
    with LoadRun.start(config) as run:
        start = run.wait_started()
        for i, stage in enumerate(stages):
            # Whole seconds inside the step (the timeline's unit), after its warm-up.
            to_s = math.floor((i + 1) * config.step_s)
            from_s = min(math.ceil((i + warmup_share) * config.step_s), to_s - 1)
            time.sleep(max(0.0, start + to_s + SETTLE_S - time.time()))
            w = run.window(since_ts=start + from_s, until_ts=start + to_s)
            whole = run.window(since_ts=start + i * config.step_s, until_ts=start + to_s)
            steps.append(step_result(stage.qps, w, whole))
            if find_knee(steps) is not None:
                break
        run.stop()
    return CapacityResult.of_steps(steps)


def render_table(result: CapacityResult) -> str:
    """The steps as a fixed-width table (offered and achieved QPS, P99, error rate by class,
    dropped sends, frame drops), the knee marked, and the sustainable QPS under it."""
    head = ["step", "offered", "achieved", "p99 ms", "5xx", "timeout", "429", "other"]
    lines = [" ".join(f"{h:>8}" for h in [*head, "dropped", "frames"])]
    for i, s in enumerate(result.steps):
        by_class = s.error_rate_by_class
        cells = [
            f"{i + 1}{' knee' if i == result.knee_index else ''}",
            f"{s.offered_qps:g}",
            f"{s.achieved_qps:.1f}",
            "-" if s.p99_ms is None else f"{s.p99_ms:.0f}",
            *(f"{by_class[c]:.1%}" for c in (*REPORTED_CLASSES, "other")),
            str(s.dropped),
            str(s.frame_drops),
        ]
        lines.append(" ".join(f"{c:>8}" for c in cells))
    knee = (
        f"knee at step {result.knee_index + 1} ({result.steps[result.knee_index].offered_qps:g} "
        "QPS offered)"
        if result.knee_index is not None
        else "no knee within the steps"
    )
    lines.append(f"{knee}; sustainable {result.sustainable_qps:.1f} QPS")
    return "\n".join(lines)


def render_svg(result: CapacityResult, title: str = "llmchaos capacity") -> str:
    """A self-contained SVG: achieved QPS (blue, left axis) and P99 (red, right axis) against
    offered QPS, the knee marked."""
    w, h, pad = 640, 400, 60
    steps = result.steps
    xs = [s.offered_qps for s in steps]
    qs = [s.achieved_qps for s in steps]
    ps = [s.p99_ms or 0.0 for s in steps]
    x_max = max(xs) * 1.05 or 1.0
    q_max = max(max(qs), max(xs)) * 1.1 or 1.0
    p_max = max(ps) * 1.1 or 1.0

    def sx(x: float) -> float:
        return pad + (w - 2 * pad) * x / x_max

    def sy(v: float, top: float) -> float:
        return h - pad - (h - 2 * pad) * v / top

    def polyline(values: list[float], top: float, color: str) -> str:
        points = " ".join(f"{sx(x):.1f},{sy(v, top):.1f}" for x, v in zip(xs, values, strict=True))
        dots = "".join(
            f'<circle cx="{sx(x):.1f}" cy="{sy(v, top):.1f}" r="3" fill="{color}"/>'
            for x, v in zip(xs, values, strict=True)
        )
        return f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{points}"/>{dots}'

    blue, red = "#1f77b4", "#d62728"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        _text(w / 2, 20, f"{title}: sustainable {result.sustainable_qps:.0f} QPS", size=14),
        _line(pad, h - pad, w - pad, h - pad),
        _line(pad, pad, pad, h - pad),
        _line(w - pad, pad, w - pad, h - pad),
        _text(w / 2, h - 15, "offered QPS"),
        _text(15, h / 2, "achieved QPS", fill=blue, rotate=-90),
        _text(w - 15, h / 2, "P99 latency (ms)", fill=red, rotate=90),
    ]
    for i in range(5):
        frac = i / 4
        parts.append(_text(sx(x_max * frac), h - pad + 15, f"{x_max * frac:.0f}"))
        parts.append(
            _text(
                pad - 5, sy(q_max * frac, q_max) + 4, f"{q_max * frac:.0f}", fill=blue, anchor="end"
            )
        )
        parts.append(
            _text(
                w - pad + 5,
                sy(p_max * frac, p_max) + 4,
                f"{p_max * frac:.0f}",
                fill=red,
                anchor="start",
            )
        )
    parts.append(polyline(qs, q_max, blue))
    parts.append(polyline(ps, p_max, red))
    if result.knee_index is not None:
        kx = sx(xs[result.knee_index])
        parts.append(_line(kx, pad, kx, h - pad, stroke="gray", dash=True))
        parts.append(_text(kx + 4, pad + 12, "knee", fill="gray", anchor="start"))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _text(
    x: float,
    y: float,
    text: str,
    *,
    fill: str = "black",
    anchor: str = "middle",
    size: int = 12,
    rotate: int = 0,
) -> str:
    turn = f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate else ""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" fill="{fill}" text-anchor="{anchor}" '
        f'font-size="{size}"{turn}>{text}</text>'
    )


def _line(
    x1: float, y1: float, x2: float, y2: float, *, stroke: str = "black", dash: bool = False
) -> str:
    pattern = ' stroke-dasharray="4 3"' if dash else ""
    points = f'x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}"'
    return f'<line {points} stroke="{stroke}"{pattern}/>'


def write_chart(result: CapacityResult, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(render_svg(result))
    return path
