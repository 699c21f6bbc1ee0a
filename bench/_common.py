"""Small measuring helpers shared by the benchmarks (run as scripts: `python bench/x.py`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from llmchaos.stack.procs import free_port, http_get_status, wait_until

__all__ = ["cpu_s", "free_port", "tree_at", "wait_http_ok"]

_REPO = Path(__file__).resolve().parent.parent


def cpu_s(pid: int) -> float:
    """utime + stime of `pid` in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http_ok(url: str, timeout_s: float = 15.0) -> None:
    """Wait until GET `url` answers 200; raises ComponentNotReady after `timeout_s`."""
    wait_until(url, lambda: http_get_status(url, 1.0) == 200, timeout_s)


def tree_at(rev: str) -> dict[str, str]:
    """The environment that makes a subprocess import `llmchaos` as of git revision `rev`:
    the package extracted under reports/bench-trees/<rev>/ (kept for the next run) and put
    first on sys.path. Raises subprocess.CalledProcessError for an unknown revision."""
    commit = subprocess.run(
        ["git", "-C", str(_REPO), "rev-parse", "--short", f"{rev}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    tree = _REPO / "reports" / "bench-trees" / commit
    if not (tree / "llmchaos").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(_REPO), "archive", commit, "llmchaos"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    # PYTHONSAFEPATH: `python -m` would otherwise put the working directory, this checkout,
    # before PYTHONPATH, and the "old" process would run the new code
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"}
