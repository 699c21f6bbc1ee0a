"""Small measuring helpers shared by the benchmarks (run as scripts: `python bench/x.py`)."""

from __future__ import annotations

import os
from pathlib import Path

from llmchaos.stack.procs import free_port, http_get_status, wait_until

__all__ = ["cpu_s", "free_port", "wait_http_ok"]


def cpu_s(pid: int) -> float:
    """utime + stime of `pid` in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http_ok(url: str, timeout_s: float = 15.0) -> None:
    """Wait until GET `url` answers 200; raises ComponentNotReady after `timeout_s`."""
    wait_until(url, lambda: http_get_status(url, 1.0) == 200, timeout_s)
