"""glibc's real allocator in this process: free blocks pinned below live ones in a thread's heap stay resident
until `return_free_memory` hands them back, and it does so only past its slack."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from kv_exporter.sidecar.allocator import FREE_SLACK_BYTES, free_heap_bytes, resident_bytes, return_free_memory
from tests.support.constants import MIB, REPO

pytestmark = pytest.mark.skipif(free_heap_bytes() is None, reason="the C library is not glibc")

BLOCK_BYTES = 1_100  # past pymalloc's 512 bytes: each block is glibc's
BLOCKS = 30_000  # ~33 MB
KEEP_EVERY = 64  # one live block in 64 pins the free ones below it


def fragment_a_thread_heap(later: list[bytes] | None = None) -> list[bytes]:
    """What parsing a folder of big manifests did: many blocks in a thread's heap, a few of which outlive it (and
    one in 8 into `later`, to be freed later)."""
    kept: list[bytes] = []

    def work() -> None:
        blocks = [bytes(BLOCK_BYTES) for _ in range(BLOCKS)]
        kept.extend(blocks[::KEEP_EVERY])
        if later is not None:
            later.extend(blocks[1::8])

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return kept


def test_free_blocks_below_live_ones_are_handed_back_past_the_slack_only() -> None:
    return_free_memory(0)
    kept = fragment_a_thread_heap()
    free, resident = free_heap_bytes(), resident_bytes()
    assert free is not None and free > 20 * MIB  # freed, yet still the allocator's
    # Under the slack: kept for reuse. (`free` counts free memory, resident or not: in a long test run it may hold
    # more than this test freed, so the slack is set from it.)
    assert return_free_memory(free + FREE_SLACK_BYTES) is False
    assert resident - resident_bytes() < 2 * MIB, "nothing was handed back"
    assert return_free_memory() is True  # past it: still free, but no longer resident
    assert resident - resident_bytes() > 16 * MIB, "the free blocks went back to the system"
    assert len(kept) == -(-BLOCKS // KEEP_EVERY)  # the live blocks survive it


def test_memory_already_handed_back_is_not_trimmed_again() -> None:
    """Today's main trimmed on every call after one large input: the free total still counts returned blocks."""
    kept = fragment_a_thread_heap()
    assert return_free_memory() is True
    free = free_heap_bytes()
    assert free is not None and free > FREE_SLACK_BYTES  # still counted free, but no longer resident
    assert [return_free_memory() for _ in range(5)] == [False] * 5
    del kept
    assert return_free_memory() is False  # only a few small blocks more
    kept = fragment_a_thread_heap()  # reuses the returned blocks, then frees them resident again
    assert return_free_memory() is True
    assert len(kept) == -(-BLOCKS // KEEP_EVERY)


def test_memory_freed_after_a_trim_is_handed_back_though_under_the_slack() -> None:
    """A large input frees part of its memory only with the scrape after its trim (5 MiB of the 12 big manifests in
    tests/reliability/test_memory.py): counting only more than the slack past that trim, it stayed resident."""
    later: list[bytes] = []
    kept = fragment_a_thread_heap(later)
    assert return_free_memory() is True
    later_bytes = len(later) * BLOCK_BYTES
    assert 2 * MIB < later_bytes < FREE_SLACK_BYTES
    resident = resident_bytes()
    del later  # freed resident, between the returned blocks
    assert return_free_memory() is True
    assert resident - resident_bytes() > 2 * MIB, "the blocks freed after the trim went back to the system"
    assert [return_free_memory() for _ in range(3)] == [False] * 3
    assert len(kept) == -(-BLOCKS // KEEP_EVERY)


# In a fresh process: eight threads allocate at once (each holding the GIL in turn while the others hold blocks),
# then glibc's own report (malloc_info) says how many heaps it made.
HEAPS_AFTER_THREADS = """
import ctypes, sys, tempfile, threading
from kv_exporter.sidecar.allocator import keep_heaps_returnable
if sys.argv[1] == "set":
    assert keep_heaps_returnable()
go, held = threading.Barrier(8), []
def work():
    go.wait()
    held.append([bytes(1_100) for _ in range(2_000)])
    go.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
libc.fclose.argtypes = (ctypes.c_void_p,)
with tempfile.NamedTemporaryFile("r") as out:
    stream = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(out.read().count("<heap nr="))
"""


def heaps_after_threads(setting: str) -> int:
    run = subprocess.run([sys.executable, "-c", HEAPS_AFTER_THREADS, setting], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True)  # fmt: skip
    return int(run.stdout)


def test_threads_share_one_heap_once_set() -> None:
    """A burst of scrapes runs collections in many worker threads: each made a heap of its own that kept its free
    blocks (tests/reliability/test_memory.py, burst). Set, they share glibc's first heap."""
    assert heaps_after_threads("default") > 1  # what glibc does unset, or this test could not fail
    assert heaps_after_threads("set") == 1
