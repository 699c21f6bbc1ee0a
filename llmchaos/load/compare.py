"""`llmchaos compare`: the same stepped load against two or more OpenAI-compatible endpoints,
one after the other or at once, and the seed's table side by side.

    endpoints = [parse_endpoint("a=http://127.0.0.1:8800,key-env=KEY_A"), ...]
    result = run_comparison(endpoints, base_config, parallel=False, out=Path("reports/x"))
    print(render_table(result))          # also compare.json, compare.md, compare.svg/png

Every figure is the load's own (llmchaos/load/README.md), per step of the profile and over the
whole run: P99 end to end from the scheduled send time (failures and timeouts at the time they
took, as the load's histograms hold them), the error rate by class (5xx, of which a provider's
503; timeout; 429; other: connection, bad body, other 4xx, sends dropped by the in-flight cap)
over the requests answered or dropped, output tokens per second of the successes, and frame
drops: gaps of 3 s or more without a successful answer (by completion instant), counted and
spaced (mean time between the starts of successive drops, as the seed's "7 times, on average
4.2 h apart").
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from llmchaos.errors import InvalidInput
from llmchaos.load.api import LoadRun, check_config
from llmchaos.load.config import LoadConfig
from llmchaos.load.profiles import build_profile
from llmchaos.load.summary import Summary
from llmchaos.load.timeline import SecondStats
from llmchaos.plotting import pyplot
from llmchaos.signals import held

__all__ = [
    "ComparisonResult",
    "Endpoint",
    "EndpointResult",
    "Figures",
    "figures_of",
    "parse_endpoint",
    "render_table",
    "run_comparison",
    "write_outputs",
]

ERROR_COLUMNS = ("5xx", "timeout", "429", "other")
"""How the table splits errors: the load's classes, with connection, bad_body, 4xx and the
in-flight cap's drops together as `other`."""
_OPTIONS = {"key-env": "api_key_env", "tokens": "tokens_file", "model": "model"}


@dataclass(frozen=True)
class Endpoint:
    """One OpenAI-compatible endpoint to load, with its own key."""

    name: str
    url: str
    api_key_env: str | None = None
    """Environment variable holding its API key (sent as `Authorization: Bearer`)."""
    tokens_file: str | None = None
    """Or a tokens file (the embedded stack's tokens.json)."""
    model: str | None = None
    """The model name to ask this endpoint for (None: the traffic's `--model`)."""


def parse_endpoint(text: str) -> Endpoint:
    """`NAME=URL[,key-env=VAR][,tokens=FILE][,model=M]`; InvalidInput names --endpoint."""
    expected = "NAME=URL[,key-env=VAR][,tokens=FILE][,model=MODEL]"
    head, *options = text.split(",")
    name, sep, url = head.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise InvalidInput(f"--endpoint: expected {expected}, got {text!r}")
    if not all(c.isalnum() or c in "-_." for c in name):
        raise InvalidInput(f"--endpoint: name {name!r}: expected letters, digits, - _ . only")
    fields: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in _OPTIONS or not value:
            raise InvalidInput(
                f"--endpoint {name}: unknown or empty option {option!r}; expected {expected}"
            )
        fields[_OPTIONS[key]] = value
    if "api_key_env" in fields and "tokens_file" in fields:
        raise InvalidInput(f"--endpoint {name}: give key-env or tokens, not both")
    return Endpoint(name=name, url=url.rstrip("/"), **fields)


@dataclass(frozen=True)
class Figures:
    """One endpoint over one span of the run (a step, or the whole run)."""

    qps: float | None
    """The step's planned rate (None for the whole run)."""
    from_s: float
    to_s: float
    scheduled: int
    ok: int
    p99_ms: float | None
    p50_ms: float | None
    error_rate: float
    """Failed or dropped share of the requests answered or dropped."""
    error_rate_by_class: dict[str, float]
    """Share per ERROR_COLUMNS."""
    tokens_per_s: float
    """Output tokens of the successes per second of the span."""
    frame_drops: int
    """Frame drops that start in the span."""
    frame_drop_spacing_s: float | None
    """Mean time between the starts of successive frame drops; None for fewer than two."""


def figures_of(
    lines: Sequence[dict[str, Any]],
    drop_events: Sequence[Sequence[float]],
    from_s: float,
    to_s: float,
    qps: float | None = None,
) -> Figures:
    """The figures of the timeline `lines` (one per scheduled second, as the load writes them)
    scheduled in [from_s, to_s), and of the frame drops starting in it."""
    merged = SecondStats()
    for line in lines:
        if from_s <= line["t"] < to_s:
            merged.merge(SecondStats.from_json(line))
    failed = merged.failed
    total = merged.done + merged.dropped
    by_class = {
        "5xx": failed.get("5xx", 0),
        "timeout": failed.get("timeout", 0),
        "429": failed.get("429", 0),
        "other": sum(failed.get(c, 0) for c in ("connection", "bad_body", "4xx")) + merged.dropped,
    }
    starts = [start for start, _ in drop_events if from_s <= start < to_s]
    spacing = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else None
    latency = merged.hist["latency_ms"]
    p99, p50 = latency.quantile(0.99), latency.quantile(0.5)
    span_s = max(to_s - from_s, 1e-9)
    return Figures(
        qps=qps,
        from_s=from_s,
        to_s=to_s,
        scheduled=merged.scheduled,
        ok=merged.ok,
        p99_ms=None if p99 is None else round(p99, 1),
        p50_ms=None if p50 is None else round(p50, 1),
        error_rate=round(sum(by_class.values()) / total, 5) if total else 0.0,
        error_rate_by_class={k: round(n / total, 5) if total else 0.0 for k, n in by_class.items()},
        tokens_per_s=round(merged.output_tokens / span_s, 1),
        frame_drops=len(starts),
        frame_drop_spacing_s=None if spacing is None else round(spacing, 1),
    )


@dataclass(frozen=True)
class EndpointResult:
    """What one endpoint's load gave."""

    endpoint: Endpoint
    run_dir: str
    summary: Summary
    steps: tuple[Figures, ...]
    whole: Figures


@dataclass(frozen=True)
class ComparisonResult:
    """Every endpoint's figures, in the order given."""

    profile: str
    parallel: bool
    endpoints: tuple[EndpointResult, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON data (an endpoint's `api_key_env` is the variable's name, never the key)."""
        return asdict(self)


def _config_for(endpoint: Endpoint, base: LoadConfig, out: Path) -> LoadConfig:
    model = endpoint.model or base.traffic.model
    traffic = replace(base.traffic, model=model)
    return replace(
        base,
        url=endpoint.url,
        api_key_env=endpoint.api_key_env,
        tokens_file=endpoint.tokens_file,
        traffic=traffic,
        run_dir=str(out / endpoint.name),
        timeline=None,
        summary_json=None,
        live_port=0,
        web_ui_port=None,
    )


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _result(endpoint: Endpoint, run: LoadRun, summary: Summary) -> EndpointResult:
    profile = build_profile(run.config)
    lines = _read_lines(run.run_dir / "timeline.jsonl")
    events = summary.frame_drop_events
    steps, start = [], 0.0
    for stage in profile.stages:
        steps.append(figures_of(lines, events, start, start + stage.duration_s, stage.qps))
        start += stage.duration_s
    whole = figures_of(lines, events, 0.0, max(summary.ran_s, start))
    return EndpointResult(endpoint, str(run.run_dir), summary, tuple(steps), whole)


def run_comparison(
    endpoints: Sequence[Endpoint], base: LoadConfig, *, parallel: bool, out: Path
) -> ComparisonResult:
    """Run `base`'s profile against every endpoint (at once when `parallel`), each into
    `out/<name>/`. Raises InvalidInput before anything starts for a bad endpoint list or
    config; an interrupt stops every load started (their summaries are still written)."""
    names = [e.name for e in endpoints]
    if len(endpoints) < 2:
        raise InvalidInput(f"--endpoint: expected at least two endpoints, got {len(endpoints)}")
    if len(set(names)) != len(names):
        raise InvalidInput(f"--endpoint: names must differ, got {', '.join(names)}")
    configs = [_config_for(e, base, out) for e in endpoints]
    for config in configs:  # every key, target and the profile before any load starts
        check_config(config)
    out.mkdir(parents=True, exist_ok=True)
    results: list[EndpointResult] = []
    started: list[LoadRun] = []
    try:
        if parallel:
            started = [LoadRun.start(config) for config in configs]
            summaries = [run.wait() for run in started]
        else:
            summaries = []
            for config in configs:
                started.append(LoadRun.start(config))
                summaries.append(started[-1].wait())
    except BaseException:
        with held("stopping the loads"):
            for run in started:
                with contextlib.suppress(Exception):
                    run.stop()
        raise
    for endpoint, run, summary in zip(endpoints, started, summaries, strict=True):
        results.append(_result(endpoint, run, summary))
    return ComparisonResult(base.profile, parallel, tuple(results))


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"


def _pct(value: float) -> str:
    return f"{value * 100:.2f}%"


def _spacing(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 3600:
        return f"{value / 3600:.1f} h"
    return f"{value / 60:.1f} min" if value >= 120 else f"{value:.0f} s"


def _rows(figures: Sequence[Figures]) -> list[tuple[str, list[str]]]:
    return [
        ("P99 latency", [_ms(f.p99_ms) for f in figures]),
        ("error rate (all classes)", [_pct(f.error_rate) for f in figures]),
        ("  5xx (503 ...)", [_pct(f.error_rate_by_class["5xx"]) for f in figures]),
        ("  timeout", [_pct(f.error_rate_by_class["timeout"]) for f in figures]),
        ("  429", [_pct(f.error_rate_by_class["429"]) for f in figures]),
        ("  other", [_pct(f.error_rate_by_class["other"]) for f in figures]),
        (
            "frame drops (>= 3 s without a success)",
            [
                f"{f.frame_drops}"
                + (f" (mean spacing {_spacing(f.frame_drop_spacing_s)})" if f.frame_drops else "")
                for f in figures
            ],
        ),
        ("output tokens/s", [f"{f.tokens_per_s:g}" for f in figures]),
        ("requests scheduled", [str(f.scheduled) for f in figures]),
    ]


def _markdown(header: list[str], rows: list[tuple[str, list[str]]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join([name, *cells]) + " |" for name, cells in rows]
    return "\n".join(lines)


def render_table(result: ComparisonResult) -> str:
    """The seed's table over the whole run, then P99 / errors / frame drops / tokens/s per
    step, as Markdown."""
    names = [r.endpoint.name for r in result.endpoints]
    out = [
        "whole run",
        _markdown(["metric", *names], _rows([r.whole for r in result.endpoints])),
        "",
        "per step",
    ]
    header = ["step (QPS)"]
    for name in names:
        header += [f"{name} P99", f"{name} errors", f"{name} drops", f"{name} tok/s"]
    rows = []
    for i, step in enumerate(result.endpoints[0].steps):
        cells = []
        for r in result.endpoints:
            f = r.steps[i]
            cells += [_ms(f.p99_ms), _pct(f.error_rate), str(f.frame_drops), f"{f.tokens_per_s:g}"]
        rows.append((f"{step.qps:g}", cells))
    out.append(_markdown(header, rows))
    return "\n".join(out) + "\n"


def write_outputs(result: ComparisonResult, out: Path) -> list[Path]:
    """compare.json, compare.md and the chart (compare.svg, compare.png) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "compare.json", out / "compare.md"]
    paths[0].write_text(json.dumps(result.to_dict(), indent=2))
    paths[1].write_text(render_table(result))
    return paths + _write_chart(result, out / "compare")


def _write_chart(result: ComparisonResult, stem: Path) -> list[Path]:
    plt = pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    (ax_p99, ax_err), (ax_tok, ax_drop) = axes
    for r in result.endpoints:
        qps = [f.qps for f in r.steps]
        style = {"marker": "o", "label": r.endpoint.name}
        ax_p99.plot(qps, [f.p99_ms or float("nan") for f in r.steps], **style)
        ax_err.plot(qps, [f.error_rate * 100 for f in r.steps], **style)
        ax_tok.plot(qps, [f.tokens_per_s for f in r.steps], **style)
    for row, r in enumerate(result.endpoints):
        for start, length in r.summary.frame_drop_events:
            ax_drop.broken_barh([(start, length)], (row - 0.3, 0.6), color=f"C{row}")
    ax_p99.set_ylabel("P99 latency (ms)")
    ax_p99.set_yscale("log")
    ax_err.set_ylabel("errors (%)")
    ax_tok.set_ylabel("output tokens/s")
    for ax in (ax_p99, ax_err, ax_tok):
        ax.set_xlabel("step (QPS)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    names = [r.endpoint.name for r in result.endpoints]
    ax_drop.set_yticks(range(len(names)), names)
    ax_drop.set_ylim(-0.6, len(names) - 0.4)
    ax_drop.set_xlabel("seconds since the load started")
    ax_drop.set_title("frame drops (>= 3 s without a successful answer)", fontsize=9)
    ax_drop.grid(alpha=0.3)
    fig.suptitle(f"llmchaos compare ({'at once' if result.parallel else 'one after the other'})")
    fig.tight_layout()
    paths = [stem.with_suffix(".svg"), stem.with_suffix(".png")]
    for path in paths:
        fig.savefig(path)
    plt.close(fig)
    return paths
