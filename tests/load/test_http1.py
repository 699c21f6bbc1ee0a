"""The incremental HTTP/1.1 response parser: framing, keep-alive, and every malformed answer."""

from __future__ import annotations

import pytest

from llmchaos.load.http1 import MAX_HEAD_BYTES, BadResponse, NoResponse, ResponseParser

BODY = b'{"choices": [{"message": {"content": "ok"}}]}'
OK = (
    b"HTTP/1.1 200 OK\r\nServer: nginx\r\nContent-Type: application/json\r\n"
    b"Content-Length: " + str(len(BODY)).encode() + b"\r\nX-Serving-Mode: gpu\r\n\r\n" + BODY
)
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n1A\r\n" + b"x" * 26 + b"\r\n0\r\nTrailer: t\r\n\r\n"
)


class Sink:
    def __init__(self) -> None:
        self.data: list[tuple[bytes, float]] = []

    def feed(self, data: bytes, now: float) -> None:
        self.data.append((data, now))


def feed_all(raw: bytes, step: int | None = None, sink: Sink | None = None) -> ResponseParser:
    """Feed `raw` in pieces of `step` bytes (all at once when None); assert it completes at
    the last piece and not before."""
    parser = ResponseParser(sink)
    pieces = [raw] if step is None else [raw[i : i + step] for i in range(0, len(raw), step)]
    for i, piece in enumerate(pieces):
        done = parser.feed(piece, float(i))
        assert done == (i == len(pieces) - 1), (i, piece)
    return parser


@pytest.mark.parametrize("step", [None, 1, 2, 7, 64])
def test_content_length_answer_in_any_pieces(step: int | None):
    parser = feed_all(OK, step)
    assert (parser.status, parser.mode, parser.keep_alive) == (200, "gpu", True)
    assert parser.body() == BODY and not parser.trailing


@pytest.mark.parametrize("step", [None, 1, 3, 10])
def test_chunked_body_with_extensions_and_trailers(step: int | None):
    parser = feed_all(CHUNKED, step)
    assert parser.body() == b"hello" + b"x" * 26
    assert parser.keep_alive and not parser.trailing


def test_body_of_a_200_goes_to_the_sink_with_its_receive_time():
    sink = Sink()
    parser = ResponseParser(sink)
    assert not parser.feed(CHUNKED[:60], 1.0)
    assert parser.feed(CHUNKED[60:], 2.0)
    assert b"".join(d for d, _ in sink.data) == b"hello" + b"x" * 26
    assert {t for _, t in sink.data} == {1.0, 2.0} and parser.body() == b""
    # An error answer is kept for classify, not streamed.
    sink = Sink()
    parser = ResponseParser(sink)
    assert parser.feed(b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy", 0.0)
    assert parser.status == 503 and parser.body() == b"busy" and sink.data == []


def test_connection_close_and_http10_are_not_kept_alive():
    closing = OK.replace(b"Server: nginx", b"Connection: close")
    assert not feed_all(closing).keep_alive
    assert not feed_all(OK.replace(b"HTTP/1.1", b"HTTP/1.0")).keep_alive
    keep = OK.replace(b"HTTP/1.1", b"HTTP/1.0").replace(b"Server: nginx", b"Connection: keep-alive")
    assert feed_all(keep).keep_alive


def test_body_until_close_ends_at_eof_and_is_not_kept_alive():
    parser = ResponseParser()
    assert not parser.feed(b"HTTP/1.1 200 OK\r\n\r\nsome", 0.0)
    assert not parser.feed(b" body", 0.0)
    assert parser.eof() and parser.body() == b"some body" and not parser.keep_alive


def test_interim_1xx_is_skipped_and_204_has_no_body():
    parser = feed_all(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)
    assert parser.status == 200 and parser.body() == BODY
    parser = ResponseParser()
    assert not parser.feed(b"HTTP/1.1 100 Continue\r\n\r\n", 0.0)
    assert parser.status == 0
    assert parser.feed(b"HTTP/1.1 204 No Content\r\n\r\n", 0.0)
    assert parser.status == 204 and parser.body() == b""


def test_bytes_after_the_answer_make_the_connection_unusable():
    assert feed_all(OK + b"HTTP/1.1 200").trailing
    assert feed_all(CHUNKED + b"junk").trailing
    parser = feed_all(OK)
    assert parser.feed(b"late junk", 0.0) and parser.trailing


def test_connection_closed_before_any_byte_is_no_response():
    with pytest.raises(NoResponse):
        ResponseParser().eof()


@pytest.mark.parametrize(
    "raw",
    [
        OK[:10],  # in the status line
        OK[: OK.index(b"\r\n\r\n")],  # in the headers
        OK[:-5],  # truncated body
        CHUNKED[:60],  # in a chunk
        CHUNKED[: CHUNKED.index(b"0\r\n")],  # before the last chunk
        CHUNKED[:-2],  # in the trailers
    ],
)
def test_connection_closed_mid_response_is_a_bad_response(raw: bytes):
    parser = ResponseParser()
    assert not parser.feed(raw, 0.0)
    with pytest.raises(BadResponse):
        parser.eof()


@pytest.mark.parametrize(
    "raw",
    [
        b"garbage\r\n\r\n",
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 20 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 0x10\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX",
    ],
)
def test_malformed_answers_are_bad_responses(raw: bytes):
    with pytest.raises(BadResponse):
        ResponseParser().feed(raw, 0.0)


def test_same_content_length_twice_is_accepted_and_chunked_wins_over_a_length():
    parser = feed_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\ncontent-length: 2\r\n\r\nok")
    assert parser.body() == b"ok"
    chunked_and_length = CHUNKED.replace(b"\r\n\r\n", b"\r\nContent-Length: 3\r\n\r\n", 1)
    assert feed_all(chunked_and_length).body() == b"hello" + b"x" * 26


def test_endless_head_or_chunk_line_is_refused():
    parser = ResponseParser()
    with pytest.raises(BadResponse):
        parser.feed(b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD_BYTES, 0.0)
    parser = ResponseParser()
    assert not parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", 0.0)
    with pytest.raises(BadResponse):
        parser.feed(b"1" * 2000, 0.0)
