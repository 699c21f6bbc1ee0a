"""Histogram merge across workers: quantiles within 1% of the exact ones from all samples."""

from __future__ import annotations

import json
import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from llmchaos.load.histogram import LogHistogram

QUANTILES = (0.5, 0.9, 0.99, 0.999)


def exact(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 20_000),
    workers=st.integers(1, 8),
    sigma=st.floats(0.1, 3.0),
)
def test_merged_quantiles_within_one_percent(seed: int, n: int, workers: int, sigma: float):
    rng = random.Random(seed)
    samples = [rng.lognormvariate(4.0, sigma) for _ in range(n)]
    parts = [LogHistogram() for _ in range(workers)]
    for i, value in enumerate(samples):
        parts[i % workers].add(value)
    # The wire format is JSON: merge what the master would receive.
    merged = LogHistogram.merged(
        LogHistogram.from_json(json.loads(json.dumps(p.to_json()))) for p in parts
    )
    assert merged.count == n
    for q in QUANTILES:
        truth = exact(samples, q)
        got = merged.quantile(q)
        assert got is not None
        assert abs(got - truth) <= 0.01 * truth, (q, got, truth)


def test_merge_is_exactly_one_histogram_of_all_samples():
    rng = random.Random(3)
    a, b, whole = LogHistogram(), LogHistogram(), LogHistogram()
    for _ in range(5000):
        x = rng.expovariate(0.01)
        (a if rng.random() < 0.3 else b).add(x)
        whole.add(x)
    a.merge(b)
    assert a.buckets == whole.buckets
    assert (a.count, a.min, a.max) == (whole.count, whole.min, whole.max)


def test_stall_tail_is_visible():
    h = LogHistogram()
    for _ in range(980):
        h.add(20.0)
    for _ in range(20):
        h.add(3000.0)
    assert h.quantile(0.5) == 20.0
    assert abs(h.quantile(0.99) - 3000.0) <= 30.0


def test_empty_and_zero_values():
    h = LogHistogram()
    assert h.quantile(0.99) is None
    h.add(0.0, 10)
    h.add(5.0)
    assert h.quantile(0.5) == 0.0
    assert h.quantile(1.0) == 5.0
