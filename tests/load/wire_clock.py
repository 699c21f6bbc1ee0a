"""The wire as the arbiter: packets on the loopback interface, timed by the kernel.

A packet socket on `lo` (root only) sees every TCP segment to and from one port; SO_TIMESTAMPNS
gives each the kernel's time, so neither the client nor the server being scheduled late moves
it. For each streamed answer on that port: when the request went out, when each content chunk
(`"content":"tok"`, the scripted server's tokens) came back, and when the chunked body ended.
"""

from __future__ import annotations

import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass, field

from llmchaos.load.stamps import ANCILLARY_BYTES, SO_TIMESTAMPNS, receive_time

__all__ = ["WireClock"]

_ETH_P_ALL = 0x0003
_PACKET_OUTGOING = 4  # loopback shows every packet twice: keep the incoming copy
_TOKENS = (b'"content":"tok"', b'"content":" tok"')


@dataclass
class _Answer:
    sent: float
    chunks: list[float] = field(default_factory=list)
    end: float | None = None


class WireClock:
    """Times the streamed answers on 127.0.0.1:`port` while running (a context manager)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.done: list[_Answer] = []
        self._open: dict[int, _Answer] = {}
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(_ETH_P_ALL))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self._sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self._sock.bind(("lo", 0))
        self._sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WireClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.2)  # the last packets
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def medians_ms(self) -> dict[str, float]:
        """Medians of TTFT and e2e (from the request's packet), ITL and TPOT, in ms."""
        answers = [a for a in self.done if a.chunks and a.end is not None]
        assert answers, "no streamed answer seen on the wire"
        gaps = [b - a for x in answers for a, b in zip(x.chunks, x.chunks[1:], strict=False)]
        return {
            "ttft": 1000 * statistics.median(a.chunks[0] - a.sent for a in answers),
            "itl": 1000 * statistics.median(gaps),
            "tpot": 1000
            * statistics.median(
                (a.end - a.chunks[0]) / (len(a.chunks) - 1)  # type: ignore[operator]
                for a in answers
                if len(a.chunks) > 1
            ),
            "e2e": 1000 * statistics.median(a.end - a.sent for a in answers),  # type: ignore[operator]
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, ancillary, _, address = self._sock.recvmsg(65536, ANCILLARY_BYTES)
            except TimeoutError:
                continue
            if address[2] == _PACKET_OUTGOING or data[12:14] != b"\x08\x00":
                continue
            stamp = receive_time(ancillary) or time.monotonic()
            ip = data[14:]
            if ip[9] != socket.IPPROTO_TCP:
                continue
            tcp = ip[(ip[0] & 0x0F) * 4 :]
            source, destination = struct.unpack_from("!HH", tcp)
            payload = tcp[(tcp[12] >> 4) * 4 :]
            if not payload:
                continue
            if destination == self.port and payload.startswith(b"POST "):
                self._open[source] = _Answer(stamp)
            elif source == self.port and (answer := self._open.get(destination)):
                answer.chunks += [stamp] * sum(payload.count(t) for t in _TOKENS)
                if payload.endswith(b"0\r\n\r\n"):
                    answer.end = stamp
                    self.done.append(self._open.pop(destination))
