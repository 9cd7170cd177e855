"""sidecar/gzipped.py: pages spliced from pieces compressed alone decompress to the page, with its CRC and length."""

from __future__ import annotations

import gzip
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_exporter.sidecar.gzipped import Gzip

# A pool of pieces: a page picks some of them (the same objects again, as frozen families come back) and new ones.
POOL = [bytes(f'family_{i}{{a="{i}"}} {i}.0\n' * (1 + 37 * i), "ascii") for i in range(6)]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.lists(st.one_of(st.sampled_from(range(len(POOL))), st.binary(max_size=3000)), max_size=8),
        min_size=1,
        max_size=6,
    )
)
def test_every_page_decompresses_to_its_pieces(pages: list[list[int | bytes]]) -> None:
    compressor = Gzip(1)
    for spec in pages:
        pieces = [POOL[p] if isinstance(p, int) else p for p in spec]
        body = compressor.page(pieces)
        assert gzip.decompress(body) == b"".join(pieces)
        assert zlib.decompress(body, 16 + zlib.MAX_WBITS) == b"".join(pieces)  # one member, trailer checked


def test_a_piece_seen_twice_is_compressed_once_then_spliced(monkeypatch: pytest.MonkeyPatch) -> None:
    compressor = Gzip(1)
    alone: list[bytes] = []
    compress_alone = compressor._compress_alone
    monkeypatch.setattr(compressor, "_compress_alone", lambda piece: alone.append(piece) or compress_alone(piece))
    frozen, changing = POOL[5], [b"x 1\n", b"x 2\n", b"x 3\n"]
    pages = [compressor.page([frozen, changing[i]]) for i in range(3)]
    assert alone == [frozen]  # the first page could not know it would come back; the third reused the second's
    assert [gzip.decompress(p) for p in pages] == [frozen + c for c in changing]
    assert len(pages[2]) < len(frozen) // 10  # still compressed
