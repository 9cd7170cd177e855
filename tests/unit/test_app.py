"""The application's answers apart from the transport: which responses are compressed."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from kv_exporter.sidecar.app import wants_gzip
from tests.support.exporter import exporter, simulated_gpu


@pytest.mark.parametrize(
    ("accept_encoding", "gzipped"),
    [
        ("gzip", True),
        ("GZIP", True),
        ("deflate, gzip;q=0.5", True),
        ("x-gzip", True),
        ("*", True),
        ("br;q=1, *;q=0.1", True),
        (" gzip ; q=1.0 ", True),
        (None, False),
        ("", False),
        ("notgzip", False),  # today's main: gzip (a substring test)
        ("gzipx, deflate", False),
        ("gzip;q=0", False),
        ("gzip;q=0.000", False),
        ("*, gzip;q=0", False),  # named gzip refused outranks the wildcard
        ("*;q=0", False),
        ("gzip;q=abc", False),
        ("gzip;q=2", False),
        ("identity", False),
    ],
)
def test_accept_encoding_is_read_as_tokens_with_q_values(accept_encoding: str | None, gzipped: bool) -> None:
    assert wants_gzip(accept_encoding) is gzipped


def test_notgzip_gets_the_plain_page(tmp_path: Path) -> None:
    with exporter(tmp_path, [], simulated_gpu()) as e:
        _, headers, body = e.get(headers={"Accept-Encoding": "notgzip"})
        assert "Content-Encoding" not in headers and body.startswith(b"#")
        _, headers, body = e.get(headers={"Accept-Encoding": "deflate, gzip;q=0.8"})
        assert headers["Content-Encoding"] == "gzip" and gzip.decompress(body).startswith(b"#")
