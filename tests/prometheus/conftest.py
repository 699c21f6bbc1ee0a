"""Debian's `prometheus` and `promtool` for the tests: installed when missing, else skipped.

Installing needs root and apt-get. Without them the tests that need the binaries are skipped,
except under CI (`CI` set), where they fail: CI runs as root and must test against the real
Prometheus. The package starts its own daemon where services may start (systemd, or an init
script without a policy-rc.d that forbids it); that daemon is stopped again, so the only
Prometheus left running is the one a test starts and stops.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "prometheus"
APT_TIMEOUT_S = 600


@dataclass(frozen=True)
class PrometheusBinaries:
    prometheus: str
    """Path of the server binary."""
    promtool: str
    """Path of promtool (rule checks and rule unit tests), from the same package."""


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    packaged = Path("/usr/bin") / name
    return str(packaged) if os.access(packaged, os.X_OK) else None


def _prometheus_pids() -> set[int]:
    pids = set()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == "prometheus":
                pids.add(int(comm.parent.name))
        except OSError:
            continue  # the process ended while we looked
    return pids


def _stop_packaged_daemon(already_running: set[int]) -> None:
    """Stop what installing the package started, and only that."""
    if Path("/run/systemd/system").is_dir():  # systemd is PID 1: the unit is the daemon
        subprocess.run(["systemctl", "stop", "prometheus.service"], check=False, timeout=60)
    elif Path("/etc/init.d/prometheus").exists():
        subprocess.run(["/etc/init.d/prometheus", "stop"], check=False, timeout=60)
    for pid in _prometheus_pids() - already_running:  # started by the install, by its pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _install() -> str | None:
    """Install the package; None when done, else why it could not be."""
    if os.geteuid() != 0:
        return f"not root: install it with `sudo apt-get install {PACKAGE}`"
    if shutil.which("apt-get") is None:
        return f"no apt-get here: install Prometheus 2.x ({PACKAGE}, promtool) by hand"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", PACKAGE]
    before = _prometheus_pids()
    try:
        done = subprocess.run(install, env=env, capture_output=True, timeout=APT_TIMEOUT_S)
        if done.returncode != 0:  # a stale package index: refresh it once
            subprocess.run(["apt-get", "update", "-qq"], env=env, timeout=APT_TIMEOUT_S)
            done = subprocess.run(install, env=env, capture_output=True, timeout=APT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"apt-get install {PACKAGE} did not finish within {APT_TIMEOUT_S} s"
    finally:
        _stop_packaged_daemon(before)
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip()[-500:]
        return f"apt-get install {PACKAGE} failed ({done.returncode}): {tail}"
    return None


@functools.cache
def _binaries() -> PrometheusBinaries | str:
    """The binaries, installing the package once per run; a string says why there are none."""
    if _which("prometheus") is None or _which("promtool") is None:
        problem = _install()
        if problem is not None:
            return problem
    prometheus, promtool = _which("prometheus"), _which("promtool")
    if prometheus is None or promtool is None:
        return f"the {PACKAGE} package is installed but prometheus or promtool is not on PATH"
    return PrometheusBinaries(prometheus, promtool)


@pytest.fixture(scope="session")
def prometheus_binaries() -> PrometheusBinaries:
    found = _binaries()
    if isinstance(found, str):
        if os.environ.get("CI"):
            pytest.fail(f"CI must test against the real Prometheus: {found}")
        pytest.skip(f"no Prometheus binary: {found}")
    return found
