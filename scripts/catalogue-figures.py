#!/usr/bin/env python3
"""The catalogue table's figures from a resilience suite's run folders: one line per case
(experiment, variant, verdict, rate, recovery, worst P99, failed of scheduled, why it failed),
read from each run's summary.json. The suite's folder is the one `pytest suites -m
resilience` prints (reports/suites/<time>/, or a game day's runs/).

    python3 scripts/catalogue-figures.py reports/suites/20261206-104521
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _line(summary: dict[str, Any]) -> str:
    load = summary.get("load") or {}
    recovery = summary.get("recovery_time_s")
    p99 = summary.get("worst_p99_ms")
    cells = [
        f"{summary['experiment']:<22}",
        f"{summary['variant']:<30}",
        f"{summary['verdict']:<4}",
        f"{summary.get('qps_run') or 0:>6.0f} QPS",
        "not recovered" if recovery is None else f"recovered {recovery:g} s",
        "worst P99 -" if p99 is None else f"worst P99 {p99 / 1000:.1f} s",
        f"{summary.get('failed_requests') or 0:,} of {load.get('scheduled') or 0:,} failed",
    ]
    if summary.get("cpu_answers"):
        cells.append(f"{summary['cpu_answers']:,} CPU answers")
    reasons = "; ".join(str(r) for r in summary.get("reasons") or [])
    return "  ".join(cells) + (f"\n    {reasons}" if reasons else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("suite_dir", type=Path, help="a suite's folder of run folders")
    args = parser.parse_args()
    summaries = sorted(args.suite_dir.glob("*/*/summary.json"))
    if not summaries:
        print(f"no */*/summary.json under {args.suite_dir}", file=sys.stderr)
        return 1
    for path in summaries:
        try:
            print(_line(json.loads(path.read_text())))
        except (ValueError, KeyError, TypeError) as exc:
            print(f"{path}: not a run summary ({exc})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
