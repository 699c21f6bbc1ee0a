"""A process may hold as many connections as it asks (llmchaos.processes.allow_open_files),
and a load process never keeps an in-flight cap its open files cannot carry."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

_PRINT_AFTER = """
import resource, sys
from llmchaos.load.user import _inflight_cap_within_open_files
cap = _inflight_cap_within_open_files(int(sys.argv[1]))
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], cap)
"""


def _after(cap: int, soft: int, hard: int) -> tuple[int, int]:
    """(soft limit, in-flight cap) in a process started with these limits, after it asked
    for `cap` requests in flight."""

    def set_limits() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    out = subprocess.run(
        [sys.executable, "-c", _PRINT_AFTER, str(cap)],
        preexec_fn=set_limits,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    limit, kept = out.stdout.split()
    return int(limit), int(kept)


def test_the_soft_limit_is_raised_for_the_cap_and_the_cap_lowered_past_the_hard_one() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 6000:
        pytest.skip(f"the hard open-file limit here is {hard}: the case needs 6000")
    # 1024 spare descriptors beside one per request in flight
    assert _after(3000, soft=1024, hard=6000) == (4024, 3000)
    assert _after(9000, soft=1024, hard=6000) == (6000, 4976)
    # a higher soft limit is left as it is
    assert _after(2000, soft=5000, hard=6000) == (5000, 2000)
