"""Give memory back after a large scrape: glibc's allocator, told to keep large blocks returnable and to return the
free memory its heaps hold once there is a lot of it.

glibc serves a block of 128 KiB or more with its own mmap, returned to the system when freed, but every time such a
block is freed it raises that threshold to the block's size (up to 32 MiB), and its heap-trim threshold to twice
that. After one large scrape (a 60,000-series engine page, a folder of 1 MiB manifests) every later block of that
size comes from the heap, whose top is trimmed only past the raised threshold: ~12 MiB more resident memory stayed
for good. Setting both thresholds keeps them where glibc starts.

Smaller blocks come from a heap (an "arena"), by default a new one for each thread that allocates while the others
are taken, up to eight per core. The scrape that finds no collection running runs it in its own worker thread, so
a burst of scrapes spread collections over many heaps, each keeping its free blocks: 200 connections at once left
+3.5 to +4.0 MiB resident, +1.6 to +1.8 with one heap. The sidecar's threads allocate while holding Python's GIL,
so one heap costs them no waiting that was measured (glibc's per-thread cache serves small blocks): ONE_HEAP.

A free block below a live one stays resident: a heap is trimmed only from its top, and `malloc_trim` only madvises
the free blocks inside. After a folder of 1 MiB manifests was parsed and removed, ~23 MB of free blocks stayed in
two thread heaps, pinned by a few small live ones (docs/reliability.md, "Memory"). So after a collection, when
glibc's heaps hold more than FREE_SLACK_BYTES free, `malloc_trim` hands it back. Other C libraries (musl) have
neither call: nothing to do there.

mallinfo2 counts a free block whether its pages are resident or were already handed back: after one trim the heaps
still count the returned blocks as free, and testing the free total alone trimmed on every scrape after. So the
last trim's figures are the baseline, and past the slack a trim runs only when there is memory to return: the free
total has grown by TRIM_MIN_BYTES past what that trim left (live memory freed since), or the process has grown
resident by the slack (returned blocks reused and freed again are resident again, the free total back where it
was). Not the slack for the first: part of a large input is freed only after the trim that follows it (5 MiB of
the 12 big files, with the next scrape), and it stayed resident for good when only more than the slack counted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from functools import cache

log = logging.getLogger(__name__)

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
ONE_HEAP = 1
THRESHOLD_BYTES = 128 << 10  # glibc's own starting value of both
# Free heap memory kept for reuse before it is handed back: 300 scrapes of the four reference manifests and the
# recorded engine page never reached it (no trim), and one large input leaves 10 to 40 MB.
FREE_SLACK_BYTES = 8 << 20
# Freed since the last trim, with the heaps past the slack, that is worth a trim: more than the few small blocks a
# quiet scrape frees, less than what a large input leaves after its trim.
TRIM_MIN_BYTES = 1 << 20


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33 and later); `fordblks` is the free memory in its heaps."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


@cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not all(hasattr(libc, f) for f in ("mallopt", "mallinfo2", "malloc_trim")):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    libc.mallinfo2.argtypes, libc.mallinfo2.restype = (), _MallInfo2
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return libc


def keep_heaps_returnable() -> bool:
    """Fix glibc's mmap and trim thresholds at THRESHOLD_BYTES and its heaps at ONE_HEAP, before the sidecar starts
    a thread; False where the C library is not glibc or refused a setting."""
    libc = _glibc()
    if libc is None:
        return False
    settings = ((_M_MMAP_THRESHOLD, THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, THRESHOLD_BYTES), (_M_ARENA_MAX, ONE_HEAP))
    refused = [option for option, value in settings if not libc.mallopt(option, value)]
    if refused:
        log.debug("mallopt refused options %s: glibc keeps its own", refused)
    return not refused


def free_heap_bytes() -> int | None:
    """The free memory glibc's heaps hold (resident or not); None where the C library is not glibc."""
    libc = _glibc()
    return None if libc is None else int(libc.mallinfo2().fordblks)


class _Returned:
    """What the last trim left: the free heap bytes (all handed back, at most) and the resident bytes."""

    lock = threading.Lock()
    free_bytes = 0
    resident_bytes = 0


def resident_bytes() -> int:
    """The process's resident memory (/proc/self/statm); 0 where /proc does not show it."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def return_free_memory(slack_bytes: int = FREE_SLACK_BYTES) -> bool:
    """Hand glibc's free heap memory back to the system when more than `slack_bytes` of it can be returned (see
    the module docstring); True if it did. mallinfo2 walks the free lists (~8 us with 40 MB in fragments); the trim
    runs only after a large input."""
    libc = _glibc()
    if libc is None:
        return False
    with _Returned.lock:
        free = int(libc.mallinfo2().fordblks)
        _Returned.free_bytes = min(_Returned.free_bytes, free)  # returned blocks reused since
        if free <= slack_bytes:  # a quiet scrape: no /proc read
            return False
        freed = free - _Returned.free_bytes > TRIM_MIN_BYTES
        if not freed and resident_bytes() - _Returned.resident_bytes <= slack_bytes:  # nor regrown
            return False
        libc.malloc_trim(0)
        _Returned.free_bytes, _Returned.resident_bytes = int(libc.mallinfo2().fordblks), resident_bytes()
    log.debug("returned free heap memory: %d bytes were free", free)
    return True
