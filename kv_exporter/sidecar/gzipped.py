"""Gzip a page given in pieces, compressing a piece that the last page also held (the same object: a frozen family's
text) once, and splicing its compressed form into every later page.

A deflate stream may be cut where the compressor was flushed with Z_FULL_FLUSH: the output ends on a byte boundary
and nothing after it refers back to what came before (RFC 1951 blocks; zlib's documentation of Z_FULL_FLUSH). So a
piece compressed alone and ended that way is valid at any such cut of any stream, as pigz builds its streams. The
gzip header and trailer (RFC 1952: CRC-32 and length of the whole page) are written here; the CRC is computed over
every piece on every page (~0.02 ms for 225 KB), the compression only over the pieces that changed.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

# RFC 1952: magic, deflate, no flags, no modification time, no extra flags, OS unknown.
_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
_RAW = -zlib.MAX_WBITS  # a deflate stream without zlib's own header
_FINAL_EMPTY_BLOCK = b"\x01\x00\x00\xff\xff"  # BFINAL=1, stored, LEN=0, NLEN=~0: the end of the stream


class Gzip:
    """Compresses pages, one page at a time (callers serialize: the app has one per shared rendering).

    One compressor serves every page and piece: each ends at a Z_FULL_FLUSH cut, after which nothing refers back,
    and a page's stream is closed by an empty final stored block (RFC 1951 3.2.4). A new compressor each page cost
    ~45 us of allocating and clearing its 256 KiB state, 15% of the compression (docs/decisions/0015-splicing-gzip.md).
    """

    def __init__(self, level: int) -> None:
        self.level = level
        self._compressor = zlib.compressobj(level, zlib.DEFLATED, _RAW)
        self._alone: dict[int, tuple[bytes, bytes]] = {}  # id -> (the piece, its deflate blocks ending in a cut)
        self._last: Sequence[bytes] = ()  # the last page's pieces, held so that their ids stay theirs

    def page(self, pieces: Sequence[bytes]) -> bytes:
        last = {id(piece) for piece in self._last}
        alone: dict[int, tuple[bytes, bytes]] = {}
        compressor = self._compressor
        out = [_HEADER]
        crc = size = 0
        for piece in pieces:
            crc, size = zlib.crc32(piece, crc), size + len(piece)
            known = self._alone.get(id(piece))
            if known is None and id(piece) not in last:
                out.append(compressor.compress(piece))
                continue
            out.append(compressor.flush(zlib.Z_FULL_FLUSH))
            if known is None:  # the same object on two pages running: it will come again
                known = (piece, self._compress_alone(piece))
            out.append(known[1])
            alone[id(piece)] = known
        out += (compressor.flush(zlib.Z_FULL_FLUSH), _FINAL_EMPTY_BLOCK, struct.pack("<II", crc, size & 0xFFFFFFFF))
        self._alone, self._last = alone, pieces
        return b"".join(out)

    def _compress_alone(self, piece: bytes) -> bytes:
        """`piece` as deflate blocks that end in a cut; called at a cut, so they refer to nothing before them."""
        return self._compressor.compress(piece) + self._compressor.flush(zlib.Z_FULL_FLUSH)
