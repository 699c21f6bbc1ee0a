"""A load process may hold as many connections as its in-flight cap asks (user.py)."""

from __future__ import annotations

import resource
import subprocess
import sys

_PRINT_SOFT_LIMIT_AFTER = """
import resource, sys
from llmchaos.load.user import _allow_open_files
_allow_open_files(int(sys.argv[1]))
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _soft_limit_after(wanted: int, soft: int, hard: int) -> int:
    def lower_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    out = subprocess.run(
        [sys.executable, "-c", _PRINT_SOFT_LIMIT_AFTER, str(wanted)],
        preexec_fn=lower_limit,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(out.stdout.strip())


def test_the_soft_limit_is_raised_to_the_cap_and_never_past_the_hard_one() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = 12_000 if hard == resource.RLIM_INFINITY else min(hard, 12_000)
    assert _soft_limit_after(4000, soft=1024, hard=hard) == min(4000, hard)
    assert _soft_limit_after(hard + 5000, soft=1024, hard=hard) == hard
    # a higher limit is left alone
    assert _soft_limit_after(2000, soft=3000, hard=hard) == 3000
