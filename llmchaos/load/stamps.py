"""Kernel receive times of socket reads (Linux SO_TIMESTAMPNS), as monotonic seconds.

With the option set on a socket, each recvmsg carries the time the kernel received the bytes
read, so a reader that was scheduled late still knows when they arrived. For several
segments in one read it is the last one's. No gevent import: the load's client, the tests'
scripted server and their packet clock share it.
"""

from __future__ import annotations

import socket
import struct
import time

__all__ = ["ANCILLARY_BYTES", "SO_TIMESTAMPNS", "receive_time"]

SO_TIMESTAMPNS = 35
"""Linux's SO_TIMESTAMPNS (= SCM_TIMESTAMPNS); the socket module does not name it."""
ANCILLARY_BYTES = socket.CMSG_SPACE(16)
"""Room for one struct timespec in recvmsg's ancillary data."""
_TIMESPEC = struct.Struct("qq")


def receive_time(ancillary: list[tuple[int, int, bytes]]) -> float | None:
    """The kernel's receive time (monotonic s) in recvmsg's ancillary data, None without."""
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(raw) >= 16:
            seconds, nanoseconds = _TIMESPEC.unpack_from(raw)
            return seconds + nanoseconds * 1e-9 - (time.time() - time.monotonic())
    return None
