"""Packet delay without netem: the kernel queues packets to this process (iptables NFQUEUE)
and lets each one go `delay_ms` +- `jitter_ms` later.

    ip netns exec NS python -m llmchaos.stack.nfqueue --queue 0 --delay-ms 100 \\
        --jitter-ms 20 --stats delay.json
    ip netns exec NS iptables -A OUTPUT ! -o lo -j NFQUEUE --queue-num 0 --queue-bypass

Why: tc netem is a kernel module (sch_netem) that some kernels lack, this machine's among
them; NFQUEUE (CONFIG_NETFILTER_XT_TARGET_NFQUEUE) is far more common. The packets are held
in the kernel, not copied out (the queue hands over their metadata only) until this process
gives the verdict ACCEPT: the delay is real, on the wire, for every protocol. Differences
from netem, stated: the jitter is uniform in [delay - jitter, delay + jitter] (netem's
default too), packets keep their order (each waits at least until the one before it has
gone; netem reorders under jitter), and at most `queue_maxlen` packets wait (netem's `limit`,
default 1000; beyond it the kernel drops). With `--queue-bypass` on the rule, packets pass
undelayed whenever no process listens, so a dead delayer never blackholes a node.

The protocol is nfnetlink_queue over a raw netlink socket (linux/netfilter/nfnetlink_queue.h),
spoken here directly: no libnetfilter_queue to build. Queue numbers are per network
namespace. `--stats` is rewritten twice a second: packets released, their mean hold, the
most waiting at once; its first write says the queue is bound. SIGTERM/SIGINT release
every held packet, unbind and exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import heapq
import json
import os
import random
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from llmchaos.errors import StackError
from llmchaos.processes import pid_alive

__all__ = [
    "DelayStats",
    "PacketDelayer",
    "check_hold",
    "command",
    "read_stats",
    "support",
    "wait_bound",
]

_NETLINK_NETFILTER = 12
_SOL_NETLINK = 270
_NETLINK_NO_ENOBUFS = 5
_NFNL_SUBSYS_QUEUE = 3
_MSG_PACKET = _NFNL_SUBSYS_QUEUE << 8 | 0
_MSG_VERDICT = _NFNL_SUBSYS_QUEUE << 8 | 1
_MSG_CONFIG = _NFNL_SUBSYS_QUEUE << 8 | 2
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NLM_F_ACK = 4
_CFG_CMD, _CFG_PARAMS, _CFG_QUEUE_MAXLEN = 1, 2, 3
_CMD_BIND, _CMD_UNBIND = 1, 2
_COPY_META = 1
_PACKET_HDR = 1
_VERDICT_HDR = 2
_NF_ACCEPT = 1
_STATS_EVERY_S = 0.5
_BIND_WAIT_S = 5.0
"""How long a delayer may take to start and bind its queue."""


def _attribute(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _message(kind: int, flags: int, seq: int, queue: int, attributes: bytes) -> bytes:
    # nfgenmsg: family AF_UNSPEC, version 0, the queue number big-endian
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack("!H", queue) + attributes
    return struct.pack("=IHHII", 16 + len(body), kind, flags, seq, 0) + body


def _attributes(data: bytes) -> dict[int, bytes]:
    found, offset = {}, 0
    while offset + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, offset)
        if length < 4:
            break
        found[kind & 0x7FFF] = data[offset + 4 : offset + length]
        offset += length + (-length % 4)
    return found


class DelayStats:
    """What a delayer wrote in its stats file."""

    def __init__(self, data: dict[str, float]) -> None:
        self.packets = int(data.get("packets", 0))
        """Packets released so far."""
        self.mean_hold_ms = float(data.get("mean_hold_ms", 0.0))
        """Their mean time held, measured by the delayer (arrival to verdict)."""
        self.most_waiting = int(data.get("most_waiting", 0))
        self.pid = int(data.get("pid", 0))


def read_stats(path: Path) -> DelayStats | None:
    """The stats file's content, None before the first write (the queue is not bound yet)."""
    try:
        return DelayStats(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return None


def command(queue: int, delay_ms: float, jitter_ms: float, stats_path: Path) -> list[str]:
    """The delayer's command line (run it inside the namespace whose packets it holds)."""
    return [
        *(sys.executable, "-m", "llmchaos.stack.nfqueue", "--queue", str(queue)),
        *("--delay-ms", f"{delay_ms:g}", "--jitter-ms", f"{jitter_ms:g}"),
        *("--stats", str(stats_path)),
    ]


def wait_bound(process: subprocess.Popen[bytes], stats_path: Path, log_path: Path) -> None:
    """Return once the delayer started by `command` has bound its queue; raises StackError
    (the process stopped, the log's last lines quoted) when it exits or takes over
    _BIND_WAIT_S."""
    deadline = time.monotonic() + _BIND_WAIT_S
    while read_stats(stats_path) is None:
        if process.poll() is not None or time.monotonic() >= deadline:
            process.kill()
            process.wait()
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise StackError(
                f"the packet delayer did not bind its queue within {_BIND_WAIT_S:g} s "
                f"(log {log_path}: {' | '.join(tail)})"
            )
        time.sleep(0.05)


def check_hold(stats_path: Path, pid: int, delay_ms: float, jitter_ms: float) -> tuple[bool, str]:
    """Whether the delayer `pid` runs and held the packets it let go for about `delay_ms` on
    average (within the jitter, plus 5 ms for its own ordering and wake-ups); the evidence."""
    stats = read_stats(stats_path)
    if stats is None or stats.pid != pid or not pid_alive(pid):
        return False, f"its delayer (pid {pid}) does not run"
    near = abs(stats.mean_hold_ms - delay_ms) <= jitter_ms + 5.0
    return stats.packets > 0 and near, (
        f"delayer pid {pid} let {stats.packets} packets go after {stats.mean_hold_ms:.1f} ms on "
        f"average (asked {delay_ms:g} +- {jitter_ms:g} ms), at most {stats.most_waiting} waiting"
    )


class PacketDelayer:
    """One bound queue: `run()` until `stop()` (see the module docstring)."""

    def __init__(
        self,
        queue: int,
        delay_ms: float,
        jitter_ms: float,
        stats_path: Path,
        queue_maxlen: int = 4096,
    ) -> None:
        if delay_ms <= 0 or jitter_ms < 0 or jitter_ms > delay_ms:
            raise StackError(
                f"delay: expected delay_ms > 0 and 0 <= jitter_ms <= delay_ms, got "
                f"{delay_ms:g} and {jitter_ms:g}"
            )
        self.queue = queue
        self.delay_s = delay_ms / 1000
        self.jitter_s = jitter_ms / 1000
        self.stats_path = Path(stats_path)
        self._maxlen = queue_maxlen
        self._seq = 0
        self._held: list[tuple[float, int, float]] = []  # (release at, packet id, arrived at)
        self._last_release = 0.0
        self._released = 0
        self._held_s_sum = 0.0
        self._most_waiting = 0
        self._stopping = False
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._sock.setsockopt(_SOL_NETLINK, _NETLINK_NO_ENOBUFS, 1)
        self._sock.bind((0, 0))

    def _request(self, attributes: bytes) -> None:
        """A config message, waiting for the kernel's acknowledgement."""
        self._seq += 1
        flags = _NLM_F_REQUEST | _NLM_F_ACK
        self._sock.send(_message(_MSG_CONFIG, flags, self._seq, self.queue, attributes))
        while True:
            data = self._sock.recv(65536)
            _, kind, _, seq, _ = struct.unpack_from("=IHHII", data)
            if kind == _NLMSG_ERROR and seq == self._seq:
                (error,) = struct.unpack_from("=i", data, 16)
                if error:
                    raise StackError(
                        f"NFQUEUE {self.queue}: the kernel refused ({os.strerror(-error)}): "
                        f"no nfnetlink_queue, not root, or the queue is taken"
                    )
                return

    def bind(self) -> None:
        self._request(_attribute(_CFG_CMD, struct.pack("!BxH", _CMD_BIND, 0)))
        self._request(_attribute(_CFG_PARAMS, struct.pack("!IB", 0, _COPY_META)))
        self._request(_attribute(_CFG_QUEUE_MAXLEN, struct.pack("!I", self._maxlen)))

    def close(self) -> None:
        """Unbind the queue (the kernel drops what still waits in it) and close."""
        try:
            self._request(_attribute(_CFG_CMD, struct.pack("!BxH", _CMD_UNBIND, 0)))
        finally:
            self._sock.close()

    def stop(self) -> None:
        self._stopping = True

    def _verdict(self, packet_id: int) -> None:
        attributes = _attribute(_VERDICT_HDR, struct.pack("!II", _NF_ACCEPT, packet_id))
        self._sock.send(_message(_MSG_VERDICT, _NLM_F_REQUEST, 0, self.queue, attributes))

    def _receive(self) -> None:
        data = self._sock.recv(1 << 20)
        now = time.monotonic()
        offset = 0
        while offset + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, offset)
            if kind == _MSG_PACKET:
                header = _attributes(data[offset + 20 : offset + length]).get(_PACKET_HDR)
                if header is not None:
                    (packet_id,) = struct.unpack_from("!I", header)
                    hold_s = self.delay_s + random.uniform(-self.jitter_s, self.jitter_s)
                    release = max(now + hold_s, self._last_release)  # keep their order
                    self._last_release = release
                    heapq.heappush(self._held, (release, packet_id, now))
            offset += max(length, 16) + (-length % 4)
        self._most_waiting = max(self._most_waiting, len(self._held))

    def _release_due(self, everything: bool = False) -> None:
        now = time.monotonic()
        while self._held and (everything or self._held[0][0] <= now):
            _, packet_id, arrived = heapq.heappop(self._held)
            self._verdict(packet_id)
            self._released += 1
            self._held_s_sum += now - arrived

    def _write_stats(self) -> None:
        mean_ms = 1000 * self._held_s_sum / self._released if self._released else 0.0
        stats = {
            "pid": os.getpid(),
            "packets": self._released,
            "mean_hold_ms": round(mean_ms, 3),
            "most_waiting": self._most_waiting,
        }
        temporary = self.stats_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(stats))
        temporary.replace(self.stats_path)

    def run(self) -> None:
        """Hold and release packets until stop(), then release every held one and close."""
        self._write_stats()
        selector = selectors.DefaultSelector()
        selector.register(self._sock, selectors.EVENT_READ)
        next_stats = time.monotonic() + _STATS_EVERY_S
        try:
            while not self._stopping:
                now = time.monotonic()
                due = self._held[0][0] if self._held else now + _STATS_EVERY_S
                for _ in selector.select(max(0.0, min(due, next_stats) - now)):
                    self._receive()
                self._release_due()
                if time.monotonic() >= next_stats:
                    self._write_stats()
                    next_stats += _STATS_EVERY_S
        finally:
            self._release_due(everything=True)
            self._write_stats()
            selector.close()
            self.close()


@functools.cache
def support() -> str | None:
    """None when this kernel lets a process take packets from an NFQUEUE, else why not
    (tried on a spare queue number of this namespace, which no rule sends to)."""
    if os.geteuid() != 0:
        return "NFQUEUE needs root"
    try:
        delayer = PacketDelayer(60000 + os.getpid() % 5000, 1.0, 0.0, Path(os.devnull))
    except OSError as exc:
        return f"no netfilter netlink socket here ({exc})"
    try:
        delayer.bind()
    except (StackError, OSError) as exc:
        return str(exc)
    finally:
        with contextlib.suppress(StackError, OSError):
            delayer.close()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, default=0, help="NFQUEUE number (0..65535)")
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--stats", type=Path, required=True, help="stats file (JSON)")
    args = parser.parse_args(argv)
    try:
        delayer = PacketDelayer(args.queue, args.delay_ms, args.jitter_ms, args.stats)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: delayer.stop())
        delayer.bind()
        delayer.run()
    except (StackError, OSError) as exc:
        print(f"llmchaos.stack.nfqueue: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
