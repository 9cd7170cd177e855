"""Reading request heads as Go's net/http does. Status and close for each kind of fault are compared with
node_exporter itself in tests/reliability/test_node_exporter_parity.py; these check what the parser hands on."""

from __future__ import annotations

import pytest

from kv_exporter.transport.request_head import (
    MAX_DISCARDED_BODY_BYTES,
    BadRequest,
    check_request_line_start,
    head_length,
    parse_head,
)

GET = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n"


def test_the_head_ends_at_the_first_empty_line_with_either_line_end() -> None:
    assert head_length(GET + b"\r\nnext") == len(GET) + 2
    assert head_length(b"GET / HTTP/1.1\nHost: x\n\nnext") == len(b"GET / HTTP/1.1\nHost: x\n\n")
    assert head_length(GET) == -1
    assert head_length(b"\r\nGET") == 2  # an empty request line: a head of its own, refused by parse_head


def test_a_trickled_head_is_found_without_rescanning() -> None:
    head = GET + b"\r\n"
    buffer, scanned = b"", 0
    for byte in head:
        buffer += bytes([byte])
        length = head_length(buffer, scanned)
        scanned = len(buffer)
    assert length == len(head)


def test_what_a_request_carries() -> None:
    request = parse_head(
        b"GET http://localhost/%6detrics?x=1 HTTP/1.1\r\nHost: localhost\r\nAccept: a\r\naccept: b\r\n"
        b"X-Folded: one\r\n two\r\nX-Bytes: \xff\r\n\r\n"
    )
    assert (request.method, request.path, request.version) == ("GET", "/metrics", (1, 1))
    assert request.header("ACCEPT") == "a" and request.headers["accept"] == ("a", "b")  # the first, as Go's Get
    assert request.header("x-folded") == "one two"
    assert request.header("x-bytes") == "\xff"
    assert request.header("absent") is None
    assert (request.discard, request.close) == (0, False)


@pytest.mark.parametrize(
    ("head", "discard", "close"),
    [
        (GET + b"Content-Length: 5\r\n\r\n", 5, False),
        (GET + b"Content-Length: %d\r\n\r\n" % MAX_DISCARDED_BODY_BYTES, MAX_DISCARDED_BODY_BYTES, False),
        (GET + b"Content-Length: %d\r\n\r\n" % (MAX_DISCARDED_BODY_BYTES + 1), 0, True),
        (GET + b"Transfer-Encoding: chunked\r\n\r\n", 0, True),
        (GET + b"Expect: 100-continue\r\nContent-Length: 5\r\n\r\n", 0, True),
        (GET + b"Expect: 100-continue\r\n\r\n", 0, False),
        (GET + b"Connection: keep-alive, close\r\n\r\n", 0, True),
        (b"GET / HTTP/1.0\r\n\r\n", 0, True),
        (b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", 0, False),
    ],
)
def test_the_body_is_dropped_or_the_connection_closed(head: bytes, discard: int, close: bool) -> None:
    request = parse_head(head)
    assert (request.discard, request.close) == (discard, close)


@pytest.mark.parametrize(
    ("head", "status", "reason"),
    [
        (GET + b"Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 400, "both Transfer-Encoding"),
        (GET + b"Transfer-Encoding: gzip, chunked\r\n\r\n", 501, "transfer encoding"),
        (GET + b"no colon\r\n\r\n", 400, "malformed MIME header line"),
        (GET + b"Host: again\r\n\r\n", 400, "too many Host"),
        (b"GET /\r\n\r\n", 400, "malformed HTTP request"),
        (b"GET / HTTP/1.x\r\nHost: x\r\n\r\n", 400, "malformed HTTP version"),
        (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505, "unsupported protocol version"),
        (b"GET / HTTP/1.1\r\n\r\n", 400, "missing required Host"),
        (GET + b"Expect: teapot\r\n\r\n", 417, "Expect"),
        (GET + b"Content-Length: 0x10\r\n\r\n", 400, "bad Content-Length"),
    ],
)
def test_refusals_carry_go_s_status_and_reason(head: bytes, status: int, reason: str) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_head(head)
    assert refused.value.status == status and reason in refused.value.reason
    answer = refused.value.answer()
    assert answer.startswith(b"HTTP/1.1 %d " % status) and b"\r\nConnection: close\r\n" in answer
    body = answer.split(b"\r\n\r\n", 1)[1]
    assert reason.encode() in body and b"Content-Length: %d\r\n" % len(body) in answer


def test_a_first_line_that_cannot_be_a_request_is_refused_before_it_ends() -> None:
    check_request_line_start(b"GET /metr")  # could still become a request
    check_request_line_start(b"GET / HTTP/1.1\r")
    for start in (b"\x16\x03\x01\x02\x00", b"GET /\x00", b"GET / HTTP/1.1\rHost"):  # a TLS ClientHello, a NUL, a CR
        with pytest.raises(BadRequest):
            check_request_line_start(start)
