#!/usr/bin/env python3
"""Where a test run's time went, per test file: the JUnit XML files `make test` writes
(reports/junit/tests.xml, tests-solo.xml, suite.xml) summed by file, slowest first. The
first part runs on TEST_WORKERS xdist workers (6, or 4 on a slow machine): its sum is the
workers' time, several times its wall time.

    python3 scripts/test-times.py [reports/junit/tests.xml ...] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_FILES = [
    "reports/junit/tests.xml",
    "reports/junit/tests-solo.xml",
    "reports/junit/suite.xml",
]


def _module(classname: str) -> str:
    """tests.stack.test_worker (a test function's classname) or tests.x.test_y.TestZ (a
    test class's): the test module."""
    parts = classname.split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_"):
            return ".".join(parts[: i + 1])
    return classname


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", default=DEFAULT_FILES, help="JUnit XML files")
    parser.add_argument("--top", type=int, default=30, help="files to list")
    args = parser.parse_args()
    seconds: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for name in args.files:
        path = Path(name)
        if not path.is_file():
            print(f"{path}: not there (written by `make test`)", file=sys.stderr)
            continue
        for case in ET.parse(path).iter("testcase"):
            module = _module(case.get("classname", "?"))
            seconds[module] += float(case.get("time", 0))
            counts[module] += 1
    total = sum(seconds.values())
    if not total:
        return 1
    print(f"{'seconds':>8} {'share':>6} {'tests':>6}  file")
    for module, s in seconds.most_common(args.top):
        print(f"{s:8.0f} {s / total:6.1%} {counts[module]:6d}  {module}")
    print(f"{total:8.0f} {'':6} {sum(counts.values()):6d}  in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
