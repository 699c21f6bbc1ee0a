"""Degraded links with the kernel's traffic control: latency and jitter (netem), a bandwidth
cap (tbf), on one end of a node's veth pair.

    tc.shape(netns, "lc1a2b-0n", delay_ms=100, jitter_ms=20, rate_kbit=512)
    tc.qdisc_stats(netns, "lc1a2b-0n")    # QdiscStats(kinds=["netem", "tbf"], packets=1234, ...)
    tc.unshape(netns, "lc1a2b-0n")

A qdisc shapes what leaves an interface: on the node's end (inside its namespace) it shapes
what the node sends (its answers), on the host's end what the node receives. That is how
Chaos Mesh's NetworkChaos applies netem and tbf (on the pod's interface, with `direction`
choosing the side). With a delay and a rate together, netem is the root and tbf its child,
as `tc-netem(8)` shows for rate limiting behind a delay.

netem is a kernel module (sch_netem) that is missing on some kernels, as on the machine
this was written on (CONFIG_NET_SCH_NETEM not set): `netem_support()` says so, and delays
are refused before a run starts; tbf (sch_tbf) is built in on most kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from dataclasses import dataclass

from llmchaos.errors import StackError

__all__ = ["QdiscStats", "netem_support", "qdisc_stats", "shape", "unshape"]

_TBF_LATENCY_MS = 400
"""Longest a packet may wait in tbf's queue before it is dropped (tc-tbf(8) `latency`):
with a cap far below what the node sends, the queue stays bounded instead of holding
seconds of answers."""


def _tc(netns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["tc", *args] if netns is None else ["ip", "netns", "exec", netns, "tc", *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise StackError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result


@functools.cache
def netem_support() -> str | None:
    """None when this kernel has netem, else why not (tried on the loopback of a throwaway
    network namespace, so no real interface is touched). Needs root."""
    if os.geteuid() != 0:
        return "tc netem needs root"
    probe = f"llmc-probe-{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot make a network namespace to try netem in: {exc}"
    try:
        tried = _tc(
            probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", check=False
        )
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    if tried.returncode != 0:
        return (
            f"this kernel has no netem qdisc (tc said: {tried.stderr.strip()}; the sch_netem "
            f"module, CONFIG_NET_SCH_NETEM): delays and jitter cannot be injected here"
        )
    return None


def shape(
    netns: str | None,
    device: str,
    *,
    delay_ms: float = 0.0,
    jitter_ms: float = 0.0,
    rate_kbit: float = 0.0,
) -> list[str]:
    """Put netem (delay +- jitter) and/or tbf (rate) on what leaves `device` (in `netns`, or
    on the host for None), replacing what llmchaos put there before. Returns the qdisc
    kinds installed. Raises StackError when tc refuses (no netem: see netem_support)."""
    unshape(netns, device)
    kinds = []
    parent = ["root"]
    if delay_ms > 0:
        netem = ["delay", f"{delay_ms:g}ms"] + ([f"{jitter_ms:g}ms"] if jitter_ms > 0 else [])
        _tc(netns, "qdisc", "add", "dev", device, *parent, "handle", "1:", "netem", *netem)
        kinds.append("netem")
        parent = ["parent", "1:1"]
    if rate_kbit > 0:
        # a bucket of at least one full frame, else tbf drops every packet bigger than it
        burst_bytes = max(1600, int(rate_kbit * 1000 / 8 / 100))
        _tc(
            netns,
            *("qdisc", "add", "dev", device, *parent, "handle", "10:", "tbf"),
            *("rate", f"{rate_kbit:g}kbit", "burst", str(burst_bytes)),
            *("latency", f"{_TBF_LATENCY_MS}ms"),
        )
        kinds.append("tbf")
    return kinds


def unshape(netns: str | None, device: str) -> None:
    """Back to the default qdisc on `device`. Idempotent (also when the device is gone)."""
    with contextlib.suppress(StackError):
        _tc(netns, "qdisc", "del", "dev", device, "root", check=False)


@dataclass(frozen=True)
class QdiscStats:
    """What shapes a device now (ours only: netem, tbf)."""

    kinds: list[str]
    packets: int
    """Sent through the root qdisc so far."""
    dropped: int
    """Dropped by any of them so far."""


def qdisc_stats(netns: str | None, device: str) -> QdiscStats:
    """What shapes `device` now; the default qdisc (noqueue, pfifo_fast, ...) is not listed."""
    listed = _tc(netns, "-s", "qdisc", "show", "dev", device, check=False).stdout
    kinds: list[str] = []
    packets = dropped = 0
    ours = root = False  # the qdisc whose statistics follow: one of ours? the root?
    for line in listed.splitlines():
        words = line.split()
        if words[:1] == ["qdisc"] and len(words) > 1:
            ours, root = words[1] in ("netem", "tbf"), "root" in words
            if ours:
                kinds.append(words[1])
        elif words[:1] == ["Sent"] and ours:
            # "Sent 1234 bytes 56 pkt (dropped 0, overlimits 0 requeues 0)"
            if root:
                packets = int(words[3])
            dropped += int(words[6].rstrip(","))
    return QdiscStats(kinds, packets, dropped)
