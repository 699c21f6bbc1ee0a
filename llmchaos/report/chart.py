"""The recovery chart: P99, error rate and serving mode over the run, fault and recovery marked.

Three panels over seconds since the load started: the rolling-window P99 against the SLO, the
rolling-window error rate against the SLO, and the share of answers per serving mode per
second. Written as PNG and SVG by matplotlib (Agg, no display needed).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmchaos.analysis import Recovery, SecondRecord, Slo, WindowVerdict
from llmchaos.plotting import keep_cache_in_llmchaos, pyplot

__all__ = ["ChartMarks", "import_matplotlib_in_background", "write_recovery_chart"]


@dataclass(frozen=True)
class ChartMarks:
    """Moments to mark, epoch seconds."""

    origin_ts: float
    """Time zero of the x axis (the load's start)."""
    fault_ts: Sequence[float]
    recovery: Recovery | None


def import_matplotlib_in_background() -> threading.Thread:
    """Import matplotlib in a thread: 0.7-0.8 s of CPU that the chart would otherwise add to a
    run's finish. The finish starts it while it waits for the load to drain (its process idle
    then); the chart's own import waits for this one where it has not ended yet."""
    keep_cache_in_llmchaos()
    thread = threading.Thread(target=_import_quietly, name="llmchaos-import-matplotlib")
    thread.start()
    return thread


def _import_quietly() -> None:
    with contextlib.suppress(Exception):  # the chart's own import reports a failure
        pyplot()


def write_recovery_chart(
    records: Sequence[SecondRecord],
    windows: Sequence[WindowVerdict],
    slo: Slo,
    marks: ChartMarks,
    out_stem: Path,
    title: str,
) -> list[Path]:
    """Write `<out_stem>.png` and `<out_stem>.svg`; returns their paths."""
    plt = pyplot()

    def x(ts: float) -> float:
        return ts - marks.origin_ts

    fig, (ax_p99, ax_err, ax_mode) = plt.subplots(
        3, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.3]}
    )
    done = [w for w in windows if w.p99_ms is not None]
    ax_p99.plot([x(w.end_ts) for w in done], [w.p99_ms for w in done], color="#1f77b4", lw=1.5)
    ax_p99.axhline(slo.p99_ms, color="#d62728", ls=":", lw=1, label=f"SLO {slo.p99_ms:g} ms")
    ax_p99.set_ylabel("P99 latency (ms)")
    ax_p99.set_yscale("log")
    ax_p99.set_title(title, fontsize=11)

    ax_err.plot(
        [x(w.end_ts) for w in windows], [w.error_rate * 100 for w in windows], color="#ff7f0e"
    )
    ax_err.axhline(slo.error_rate * 100, color="#d62728", ls=":", lw=1, label="SLO")
    ax_err.set_ylabel("errors (%)")
    ax_err.set_ylim(bottom=0)

    xs = [x(r.ts + 0.5) for r in records]
    totals = [max(1, sum(r.modes.values())) for r in records]
    gpu = [r.modes.get("gpu", 0) / t for r, t in zip(records, totals, strict=True)]
    cpu = [r.modes.get("cpu", 0) / t for r, t in zip(records, totals, strict=True)]
    ax_mode.stackplot(xs, gpu, cpu, colors=["#2ca02c", "#9467bd"], labels=["gpu", "cpu"])
    ax_mode.set_ylabel("served by")
    ax_mode.set_ylim(0, 1)
    ax_mode.set_xlabel("seconds since the load started (requests by scheduled time)")
    ax_mode.legend(loc="lower left", fontsize=8, ncols=2)

    for ax in (ax_p99, ax_err, ax_mode):
        for i, fault in enumerate(marks.fault_ts):
            ax.axvline(x(fault), color="#d62728", lw=1.2, label="fault" if i == 0 else None)
        rec = marks.recovery
        if rec is not None and rec.detected_at_ts is not None:
            ax.axvline(x(rec.detected_at_ts), color="#ff7f0e", ls="--", lw=1, label="detected")
        if rec is not None and rec.recovered_at_ts is not None:
            ax.axvline(x(rec.recovered_at_ts), color="#2ca02c", ls="--", lw=1.2, label="recovered")
            if rec.recovery_time_s:
                ax.axvspan(x(rec.fault_ts), x(rec.recovered_at_ts), color="#d62728", alpha=0.08)
        ax.grid(alpha=0.3)
    ax_p99.legend(loc="upper left", fontsize=8, ncols=4)
    fig.tight_layout()
    paths = [out_stem.with_suffix(".png"), out_stem.with_suffix(".svg")]
    for path in paths:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return paths
