"""A small mergeable histogram with log-spaced buckets (DDSketch/HDR style).

Every positive value v falls in bucket ceil(log_gamma(v)) with gamma = (1 + a) / (1 - a); the
bucket's representative value is within a relative error `a` of every value in it, so any
quantile read from the histogram is within `a` of the exact sample at the same rank. Merging two
histograms adds their bucket counts, which is exact: the merged quantiles are as good as those of
one histogram fed with all samples. That is what lets the workers send histograms instead of
samples. Values <= 0 go to a zero bucket.

Plain Python and no Locust/gevent import: the master, the library API and the analysis use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = ["RELATIVE_ERROR", "LogHistogram"]

RELATIVE_ERROR = 0.005
"""Relative error of every quantile (0.5%, half the 1% the issue asks for, so merged and
rounded figures stay well inside it)."""

_GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
_LOG_GAMMA = math.log(_GAMMA)


class LogHistogram:
    """Counts of values in log-spaced buckets; add, merge, quantile, serialise."""

    __slots__ = ("buckets", "count", "max", "min", "sum", "zero_count")

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.zero_count = 0
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(self, value: float, n: int = 1) -> None:
        """Record `value` `n` times."""
        self.count += n
        self.sum += value * n
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value
        if value <= 0.0:
            self.zero_count += n
            return
        index = math.ceil(math.log(value) / _LOG_GAMMA)
        self.buckets[index] = self.buckets.get(index, 0) + n

    def merge(self, other: LogHistogram) -> None:
        """Add all of `other`'s counts to this histogram (exact)."""
        if other.count == 0:
            return
        for index, n in other.buckets.items():
            self.buckets[index] = self.buckets.get(index, 0) + n
        self.zero_count += other.zero_count
        self.count += other.count
        self.sum += other.sum
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    @classmethod
    def merged(cls, histograms: Iterable[LogHistogram]) -> LogHistogram:
        """A new histogram holding the sum of `histograms`."""
        out = cls()
        for histogram in histograms:
            out.merge(histogram)
        return out

    def quantile(self, q: float) -> float | None:
        """The value at quantile `q` (0..1, nearest rank), or None when empty.

        Raises ValueError when q is outside 0..1.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be within 0..1, got {q}")
        if self.count == 0:
            return None
        rank = max(1, math.ceil(q * self.count))
        if rank == self.count:
            return self.max
        if rank <= self.zero_count:
            return 0.0
        seen = self.zero_count
        for index in sorted(self.buckets):
            seen += self.buckets[index]
            if seen >= rank:
                # The midpoint (in relative terms) of (gamma^(i-1), gamma^i].
                value = 2.0 * _GAMMA**index / (_GAMMA + 1.0)
                return min(max(value, self.min), self.max)
        return self.max

    def mean(self) -> float | None:
        """Arithmetic mean of the recorded values, or None when empty."""
        return self.sum / self.count if self.count else None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; `from_json` restores it exactly."""
        if self.count == 0:
            return {"n": 0}
        return {
            "n": self.count,
            "sum": self.sum,
            "min": self.min,
            "max": self.max,
            "zero": self.zero_count,
            "b": [[index, n] for index, n in self.buckets.items()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LogHistogram:
        """The histogram `to_json` produced. Raises KeyError/TypeError on a malformed dict."""
        out = cls()
        if not data.get("n"):
            return out
        out.count = int(data["n"])
        out.sum = float(data["sum"])
        out.min = float(data["min"])
        out.max = float(data["max"])
        out.zero_count = int(data["zero"])
        out.buckets = {int(index): int(n) for index, n in data["b"]}
        return out
