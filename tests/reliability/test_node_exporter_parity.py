"""The same raw bytes to the sidecar process and to Debian's node_exporter (Go's net/http behind the exporter-toolkit):
the statuses that come back and whether the connection closes must be the same, request by request, except for the
differences docs/reliability.md lists (*Differences from node_exporter*), which are checked here as they are."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.constants import SIMULATE_GPU
from tests.support.node_exporter import node_exporter
from tests.support.raw_http import Exchange, exchange
from tests.support.sidecar import sidecar

GET = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n"
SMUGGLED = b"GET /metrics?smuggled HTTP/1.1\r\nHost: localhost\r\n\r\n"

CASES: dict[str, bytes] = {
    "plain": GET + b"\r\n",
    "head": b"HEAD /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "query": b"GET /metrics?x=1 HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "absolute_form": b"GET http://localhost/metrics HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "percent_encoded_path": b"GET /%6detrics HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "bare_lf_line_ends": b"GET /metrics HTTP/1.1\nHost: localhost\n\n",
    "pipelined": GET + b"\r\n" + GET + b"\r\n",
    "connection_close": GET + b"Connection: close\r\n\r\n",
    "http_1_0": b"GET /metrics HTTP/1.0\r\n\r\n",
    "http_1_2": b"GET /metrics HTTP/1.2\r\nHost: localhost\r\n\r\n",
    "small_body": GET + b"Content-Length: 5\r\n\r\nhello",
    "body_that_looks_like_a_request": GET + b"Content-Length: %d\r\n\r\n" % len(SMUGGLED) + SMUGGLED,
    "body_too_large_to_drop": GET + b"Content-Length: 1000000\r\n\r\n" + SMUGGLED,
    "expect_100_continue_with_body": GET + b"Expect: 100-continue\r\nContent-Length: 3\r\n\r\n",
    "expect_100_continue_without_body": GET + b"Expect: 100-continue\r\n\r\n",
    "expect_unknown": GET + b"Expect: something\r\n\r\n",
    "equal_content_lengths": GET + b"Content-Length: 0\r\nContent-Length: 0\r\n\r\n",
    "differing_content_lengths": GET + b"Content-Length: 0\r\nContent-Length: 1\r\n\r\nx",
    "negative_content_length": GET + b"Content-Length: -1\r\n\r\n",
    "non_numeric_content_length": GET + b"Content-Length: abc\r\n\r\n",
    "unsupported_transfer_encoding": GET + b"Transfer-Encoding: gzip\r\n\r\n",
    "two_transfer_encodings": GET + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "header_line_without_colon": GET + b"Broken header\r\n\r\n",
    "header_with_empty_name": GET + b": value\r\n\r\n",
    "space_before_colon": GET + b"Name : value\r\n\r\n",
    "invalid_header_name": GET + b"Na(me: value\r\n\r\n",
    "control_character_in_value": GET + b"Name: a\x01b\r\n\r\n",
    "nul_in_value": GET + b"Name: a\x00b\r\n\r\n",
    "non_ascii_value": GET + b"Name: \xff\r\n\r\n",
    "folded_header": GET + b"Name: a\r\n b\r\n\r\n",
    "first_header_folded": b"GET /metrics HTTP/1.1\r\n Host: localhost\r\n\r\n",
    "duplicate_host": GET + b"Host: other\r\n\r\n",
    "duplicate_host_other_case": GET + b"HOST: localhost\r\n\r\n",
    "missing_host": b"GET /metrics HTTP/1.1\r\n\r\n",
    "missing_host_http_1_0": b"GET /metrics HTTP/1.0\r\n\r\n",
    "empty_host": b"GET /metrics HTTP/1.1\r\nHost:\r\n\r\n",
    "malformed_host": b"GET /metrics HTTP/1.1\r\nHost: a b\r\n\r\n",
    "host_with_port_and_v6": b"GET /metrics HTTP/1.1\r\nHost: [::1]:9477\r\n\r\n",
    "http_0_9": b"GET /metrics\r\n\r\n",
    "http_0_9_version": b"GET /metrics HTTP/0.9\r\nHost: localhost\r\n\r\n",
    "http_2_0_version": b"GET /metrics HTTP/2.0\r\nHost: localhost\r\n\r\n",
    "http_3_0_version": b"GET /metrics HTTP/3.0\r\nHost: localhost\r\n\r\n",
    "malformed_version": b"GET /metrics HTTP/x\r\nHost: localhost\r\n\r\n",
    "lower_case_version": b"GET /metrics http/1.1\r\nHost: localhost\r\n\r\n",
    "h2c_preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "two_spaces": b"GET  /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "tabs_for_spaces": b"GET\t/metrics\tHTTP/1.1\r\nHost: localhost\r\n\r\n",
    "trailing_space": b"GET /metrics HTTP/1.1 \r\nHost: localhost\r\n\r\n",
    "invalid_method": b"G(T /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "relative_target": b"GET metrics HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "asterisk_target": b"GET * HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "control_character_in_target": b"GET /met\x01rics HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "bad_percent_escape": b"GET /%zz HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "bare_cr": b"GET /metrics HTTP/1.1\rHost: localhost\r\r\n\r\n",
    "leading_empty_line": b"\r\n" + GET + b"\r\n",
    "only_an_empty_line": b"\r\n\r\n",
    "binary_garbage": b"\x00\x01\x02\x03 garbage\r\n\r\n",
    "head_over_1_mib": GET + b"X: " + b"a" * (1100 << 10) + b"\r\n\r\n",
    # Where the sidecar answers otherwise, on purpose (docs/reliability.md):
    "content_length_and_transfer_encoding": GET + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "chunked_body": GET + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(SMUGGLED) + SMUGGLED + b"\r\n0\r\n\r\n",
    "post": b"POST /metrics HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n",
    "options_asterisk": b"OPTIONS * HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "http_1_0_keep_alive": b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    "head_over_64_kib": GET + b"X: " + b"a" * (100 << 10) + b"\r\n\r\n",
}

# case -> (the sidecar's exchange, node_exporter's)
DIFFERENCES: dict[str, tuple[Exchange, Exchange]] = {
    "content_length_and_transfer_encoding": (Exchange((400,), True), Exchange((200,), False)),
    "chunked_body": (Exchange((200,), True), Exchange((200,), False)),
    "post": (Exchange((405,), False), Exchange((200,), False)),
    "options_asterisk": (Exchange((405,), False), Exchange((200,), False)),
    "http_1_0_keep_alive": (Exchange((200,), False), Exchange((200,), True)),
    "head_over_64_kib": (Exchange((431,), True), Exchange((200,), False)),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[tuple[str, int], tuple[str, int]]]:
    """(the sidecar's address, node_exporter's), both on 127.0.0.1."""
    workdir = tmp_path_factory.mktemp("parity")
    with (
        sidecar(workdir, "--manifest-dir", str(workdir / "m"), *SIMULATE_GPU) as sc,
        node_exporter(workdir) as (_, reference),
    ):
        yield ("127.0.0.1", sc.port), reference
        assert sc.stop() == 0


@pytest.mark.parametrize("case", CASES)
def test_answers_match_node_exporter(servers: tuple[tuple[str, int], tuple[str, int]], case: str) -> None:
    ours, theirs = (exchange(address, CASES[case]) for address in servers)
    assert (ours, theirs) == DIFFERENCES.get(case, (theirs, theirs))
