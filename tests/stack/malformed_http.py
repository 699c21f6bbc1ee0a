"""Requests no HTTP/1.1 server can parse: the workers' and gateways' server must answer each
with a short 400 and one log line, never a traceback (tests/stack/test_httpserver.py and,
through a whole gateway, tests/stack/test_gateway_fuzz.py)."""

from __future__ import annotations

import pytest

MALFORMED_REQUESTS = [
    pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", id="bad-length"),
    pytest.param(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"\r\nzz\r\n",
        id="bad-chunk",
    ),
    pytest.param(b"BREW /v1/chat/completions HTTP/1.1\r\n\r\n", id="bad-method"),
    # a TLS ClientHello to a plain port
    pytest.param(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", id="tls"),
    pytest.param(b"POST /v1/chat/completions HTTP/9.9\r\n\r\n", id="bad-version"),
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nHost x\r\n\r\n", id="bad-header"),
    pytest.param(
        b"POST /v1/chat/completions HTTP/1.1\r\n" + b"X-Big: " + b"a" * 70_000 + b"\r\n\r\n",
        id="huge-header",
    ),
]
