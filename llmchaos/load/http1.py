"""An incremental parser of one HTTP/1.1 response, fed with what the raw socket gives.

The open-loop user reads answers in the gevent loop's callbacks, a recv at a time, so the parser
takes bytes as they come (`feed`) and the end of the connection (`eof`). It knows what a load
client needs and no more: the status, `X-Serving-Mode`, keep-alive, and the body framed by
Content-Length, chunked encoding or the end of the connection. No gevent import: testable alone.

Failures: `NoResponse` when the connection ended before any byte of the answer (class
"connection"), `BadResponse` for anything malformed or cut short after the first byte
("bad_body"), as geventhttpclient's parser classed them before.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["BadResponse", "BodySink", "NoResponse", "ResponseParser"]

MAX_HEAD_BYTES = 65536
"""A status line and headers longer than this are refused (no real server sends that)."""
_MAX_CHUNK_LINE = 1024
_MODE_HEADERS = (b"x-serving-mode", b"llm_provider-x-serving-mode")
"""Where the serving mode arrives: from the gateway, or through LiteLLM, which passes every
upstream header on with the prefix `llm_provider-`."""
_HEX = b"0123456789abcdefABCDEF"

# How the body ends.
_NONE, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(4)
# Where a chunked body is.
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


class BadResponse(Exception):
    """The bytes received are not a complete, valid HTTP/1.1 response."""


class NoResponse(Exception):
    """The connection ended before any byte of the response."""


class BodySink(Protocol):
    """Takes the body of a 200 answer as it arrives (SSE streams), instead of buffering it."""

    def feed(self, data: bytes, now: float) -> None: ...


class ResponseParser:
    """One response. `feed` until it returns True (complete); `eof` when the peer closed."""

    __slots__ = (
        "_body",
        "_buf",
        "_chunk_state",
        "_framing",
        "_remaining",
        "_sink",
        "complete",
        "keep_alive",
        "mode",
        "received",
        "status",
        "trailing",
    )

    def __init__(self, sink: BodySink | None = None) -> None:
        """`sink`: where the body of a 200 answer goes; other bodies are kept (`body()`)."""
        self.status = 0
        """Status code; 0 until the head of a final (non-1xx) response is parsed."""
        self.mode: str | None = None
        """The X-Serving-Mode header (or LiteLLM's llm_provider-x-serving-mode)."""
        self.keep_alive = False
        self.complete = False
        self.trailing = False
        """Bytes came after the end of the response: the connection is not reusable."""
        self.received = False
        self._sink = sink
        self._buf = b""
        self._body: list[bytes] = []
        self._framing = _NONE
        self._remaining = 0
        self._chunk_state = _SIZE

    def body(self) -> bytes:
        """The body received (empty when it went to the sink)."""
        return b"".join(self._body)

    def feed(self, data: bytes, now: float) -> bool:
        """Take the next bytes; True once the response is complete. Raises BadResponse."""
        if self.complete:
            self.trailing = self.trailing or bool(data)
            return True
        self.received = True
        while self.status == 0:
            buf = self._buf + data if self._buf else data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise BadResponse("response head too long")
                self._buf = buf
                return False
            self._buf = b""
            data = buf[end + 4 :]
            self._head(buf[:end])
            if self.status == 0 and not data:  # an interim 1xx answer; the final one follows
                return False
        if self._framing == _NONE:
            return self._finish(data)
        if self._framing == _LENGTH:
            take = data[: self._remaining] if len(data) > self._remaining else data
            if take:
                self._deliver(take, now)
            self._remaining -= len(take)
            if self._remaining == 0:
                return self._finish(data[len(take) :])
            return False
        if self._framing == _CHUNKED:
            return self._chunks(data, now)
        if data:
            self._deliver(data, now)
        return False

    def eof(self) -> bool:
        """The peer closed the connection: True if that ends the response (a body framed by
        the close). Raises NoResponse (nothing received) or BadResponse (cut short)."""
        if self.complete:
            return True
        if not self.received:
            raise NoResponse("connection closed before the response")
        if self.status and self._framing == _UNTIL_CLOSE:
            self.complete = True
            return True
        raise BadResponse("connection closed mid-response")

    def _deliver(self, data: bytes, now: float) -> None:
        if self._sink is not None and self.status == 200:
            self._sink.feed(data, now)
        else:
            self._body.append(data)

    def _finish(self, rest: bytes) -> bool:
        self.complete = True
        self.trailing = bool(rest)
        return True

    def _head(self, head: bytes) -> None:
        """Parse the status line and headers; sets status 0 again for an interim answer."""
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        code = rest[:3]
        if (
            version not in (b"HTTP/1.1", b"HTTP/1.0")
            or len(code) != 3
            or not code.isdigit()
            or rest[3:4] not in (b"", b" ")
        ):
            raise BadResponse(f"bad status line {lines[0][:80]!r}")
        status = int(code)
        length: int | None = None
        chunked = te = False
        connection = b""
        mode = None
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name[-1:] in (b" ", b"\t"):
                raise BadResponse(f"bad header line {line[:80]!r}")
            name = name.lower()
            if name == b"content-length":
                value = value.strip()
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise BadResponse(f"bad Content-Length {value[:40]!r}")
                length = int(value)
            elif name == b"transfer-encoding":
                te = True
                chunked = value.strip().lower().endswith(b"chunked")
            elif name == b"connection":
                connection = value.strip().lower()
            elif name in _MODE_HEADERS:
                mode = value.strip().decode("latin-1")
        if status < 200:
            if status == 101:
                raise BadResponse("unexpected protocol switch")
            return  # 1xx: skipped, status stays 0
        self.status = status
        self.mode = mode
        if version == b"HTTP/1.1":
            self.keep_alive = b"close" not in connection
        else:
            self.keep_alive = b"keep-alive" in connection
        if status in (204, 304):
            self._framing = _NONE
        elif te:
            # A length next to chunked coding is ignored (RFC 9112 6.3); an encoding that is
            # not chunked runs to the close.
            self._framing = _CHUNKED if chunked else _UNTIL_CLOSE
        elif length is not None:
            self._framing = _LENGTH if length else _NONE
            self._remaining = length
        else:
            self._framing = _UNTIL_CLOSE
        if self._framing == _UNTIL_CLOSE:
            self.keep_alive = False

    def _chunks(self, data: bytes, now: float) -> bool:
        buf = self._buf + data if self._buf else data
        pos, end = 0, len(buf)
        while pos < end:
            state = self._chunk_state
            if state == _DATA:
                take = min(self._remaining, end - pos)
                self._deliver(buf[pos : pos + take], now)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._chunk_state = _DATA_END
            elif state == _DATA_END:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise BadResponse("chunk not followed by CRLF")
                pos += 2
                self._chunk_state = _SIZE
            else:  # _SIZE or _TRAILER: a line
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > _MAX_CHUNK_LINE:
                        raise BadResponse("chunk line too long")
                    break
                line = buf[pos:eol]
                pos = eol + 2
                if state == _TRAILER:
                    if not line:
                        self._buf = b""
                        return self._finish(buf[pos:])
                    continue
                size = line.partition(b";")[0].strip()
                if not size or len(size) > 16 or size.strip(_HEX):
                    raise BadResponse(f"bad chunk size {line[:40]!r}")
                self._remaining = int(size, 16)
                self._chunk_state = _DATA if self._remaining else _TRAILER
        self._buf = buf[pos:]
        return False
