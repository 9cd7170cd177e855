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


class Gzip:
    """Compresses pages, one page at a time (callers serialize: the app has one per shared rendering)."""

    def __init__(self, level: int) -> None:
        self.level = level
        self._alone: dict[int, tuple[bytes, bytes]] = {}  # id -> (the piece, its deflate blocks ending in a cut)
        self._last: Sequence[bytes] = ()  # the last page's pieces, held so that their ids stay theirs

    def page(self, pieces: Sequence[bytes]) -> bytes:
        last = {id(piece) for piece in self._last}
        alone: dict[int, tuple[bytes, bytes]] = {}
        running = zlib.compressobj(self.level, zlib.DEFLATED, _RAW)
        out = [_HEADER]
        crc = size = 0
        for piece in pieces:
            crc, size = zlib.crc32(piece, crc), size + len(piece)
            known = self._alone.get(id(piece))
            if known is None and id(piece) in last:  # the same object on two pages running: it will come again
                known = (piece, self._compress_alone(piece))
            if known is None:
                out.append(running.compress(piece))
                continue
            out += (running.flush(zlib.Z_FULL_FLUSH), known[1])
            alone[id(piece)] = known
        out += (running.flush(), struct.pack("<II", crc, size & 0xFFFFFFFF))
        self._alone, self._last = alone, pieces
        return b"".join(out)

    def _compress_alone(self, piece: bytes) -> bytes:
        compressor = zlib.compressobj(self.level, zlib.DEFLATED, _RAW)
        return compressor.compress(piece) + compressor.flush(zlib.Z_FULL_FLUSH)
