"""The CFS quota and period a CPU cap is written as (the kernel's throttling itself is
checked in tests/hosts/test_faults.py and tests/stack/test_verification.py)."""

from __future__ import annotations

import pytest

from llmchaos.errors import InvalidInput
from llmchaos.targets.cpu_throttle import cpu_max


@pytest.mark.parametrize(
    ("cpu_percent", "quota_and_period_us"),
    [
        (150, (150_000, 100_000)),  # more than one CPU: the quota may pass the period
        (2.5, (2_500, 100_000)),
        (1, (1_000, 100_000)),
        (0.999, (1_000, 100_100)),  # under 1%: 1 ms per a longer period, not rounded to 1%
        (0.5, (1_000, 200_000)),
        (0.1, (1_000, 1_000_000)),  # the kernel's longest period
    ],
)
def test_a_cap_is_the_share_asked(cpu_percent: float, quota_and_period_us: tuple[int, int]) -> None:
    assert cpu_max(cpu_percent) == quota_and_period_us
    quota_us, period_us = quota_and_period_us
    assert quota_us / period_us == pytest.approx(cpu_percent / 100, rel=1e-3)


def test_a_cap_under_what_the_kernel_can_give_is_refused() -> None:
    with pytest.raises(InvalidInput, match=r"cpu_percent: expected at least 0.1 .* got 0.05"):
        cpu_max(0.05)
