"""Give memory back after a large scrape: glibc's allocator, told to keep large blocks returnable.

glibc serves a block of 128 KiB or more with its own mmap, returned to the system when freed, but every time such a
block is freed it raises that threshold to the block's size (up to 32 MiB), and its heap-trim threshold to twice
that. After one large scrape (a 60,000-series engine page, a folder of 1 MiB manifests) every later block of that
size comes from the heap, whose top is trimmed only past the raised threshold: ~12 MiB more resident memory stayed
for good (docs/reliability.md, "Memory"). Setting both thresholds keeps them where glibc starts. Other C libraries
(musl) have no mallopt: nothing to do there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 128 << 10  # glibc's own starting value of both


def keep_large_blocks_returnable() -> bool:
    """Fix glibc's mmap and trim thresholds at THRESHOLD_BYTES; False where the C library has no mallopt."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES))
    if not done:
        log.debug("mallopt refused the thresholds: glibc keeps its dynamic ones")
    return done
