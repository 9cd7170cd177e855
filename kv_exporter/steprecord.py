"""The step record: what a worker runs, step by step, published in a small memory-mapped file beside its manifest.

The second half of the contract between the hook and the sidecar (the manifest is the first): the hook writes, at
the start and at the end of each step the model runner executes, how many sequences the step runs, and the most any
step ran in each second; the sidecar reads it at scrape time. No system call and no allocation per step (the writer is
the plugin's C helper, `kv_exporter/plugin/_steps.c`; `RecordWriter` below is the same protocol in Python, for the
demo and the tests).

The file: `<manifest name without .json>.steps` in the manifest's folder (`record_name`), one per worker, made whole
before it appears (written aside, then renamed), removed with the manifest at a clean exit. Little-endian, fixed size
(`RECORD_BYTES`), version `VERSION`:

    offset size field
         0    8 magic              b"KVXSTEPS"
         8    4 version            1 (a reader refuses another)
        12    4 header_bytes       128 (where the buckets start)
        16    4 bucket_count       128
        20    4 (zero)
        24    8 bucket_ns          1,000,000,000 (one second per bucket)
        32    8 pid                the writer's pid ...
        40    8 start_time_ticks   ... and start time (/proc/PID/stat field 22): the manifest's `process`
        48    8 seq                even while the record is consistent; odd while a write is in progress
        56    8 steps              steps begun
        64    8 finished           steps ended (returned or raised): steps - finished is 1 while one runs
        72    8 latest             sequences the latest step runs (UNKNOWN: its scheduler output could not be read)
        80    8 latest_started_ns  when the latest step began  (CLOCK_MONOTONIC, nanoseconds)
        88    8 latest_finished_ns when the latest step ended (0: none has)
        96    8 unreadable         steps whose count could not be read
       104   24 (zero)
       128   16 x bucket_count: bucket index (time_ns // bucket_ns; -1: never written), most (sequences)

A bucket holds the most any step ran in that second: written at a step's start and at its end (so a step spanning
seconds counts in each one it ends or starts in), slot `index % bucket_count`, reset when a newer second takes it. A
reader keeps the buckets whose index falls in its window; nothing is ever reset by reading, so any number of readers
each see every step's count.

Writing (a seqlock): seq += 1 (odd), the fields, seq += 1 (even), with release ordering. Reading: two copies of the
whole record, one after the other; they are consistent when equal with an even seq (`read_consistent`). A writer
that died or hangs in the middle of a write leaves seq odd (`torn`); one whose process lives but whose steps stop
advancing is the reader's to judge from the times (`kv_exporter.sidecar.running`). The clock is CLOCK_MONOTONIC
(the writer reads its coarse variant, within a tick): reader and writer share the node's kernel, as the folder.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kv_exporter.manifest import MANIFEST_SUFFIX

MAGIC = b"KVXSTEPS"
VERSION = 1
STEPS_SUFFIX = ".steps"
HEADER = struct.Struct("<8sIIIIQqqQQQQqqQ24x")
BUCKET = struct.Struct("<qQ")
HEADER_BYTES = HEADER.size
BUCKET_COUNT = 128
BUCKET_NS = 1_000_000_000
RECORD_BYTES = HEADER_BYTES + BUCKET_COUNT * BUCKET.size
UNKNOWN = (1 << 64) - 1  # `latest` of a step whose count could not be read
NEVER = -1  # the index of a bucket never written
SEQ_OFFSET = 48
_SEQ = struct.Struct("<Q")
_COUNTERS = struct.Struct("<QQQQqqQ")  # seq, steps, finished, latest, latest_started_ns, latest_finished_ns, unreadable
_STATE_AT = 32
_STATE = struct.Struct("<qq" + _COUNTERS.format.removeprefix("<"))  # pid, start_time_ticks, then the counters
_BUCKETS_AT = HEADER_BYTES
READ_ATTEMPTS = 4  # a write takes tens of nanoseconds: a copy that caught one is taken again


def record_name(manifest_name: str) -> str:
    """The record's file name beside the manifest named `manifest_name`."""
    return manifest_name.removesuffix(MANIFEST_SUFFIX) + STEPS_SUFFIX


def new_record(pid: int, start_time_ticks: int | None) -> bytes:
    """A record of a worker that has run no step yet."""
    header = HEADER.pack(
        MAGIC, VERSION, HEADER_BYTES, BUCKET_COUNT, 0, BUCKET_NS, pid, start_time_ticks or 0, 0, 0, 0, 0, 0, 0, 0
    )
    return header + BUCKET.pack(NEVER, 0) * BUCKET_COUNT


# What every version 1 record starts with: magic, version and geometry (its first 32 bytes, before the pid).
_GEOMETRY = new_record(0, 0)[:_STATE_AT]


class RecordProblem(str, Enum):
    """Why a record cannot be used (a metric label)."""

    INVALID = "invalid"  # not a record of this version: wrong size, magic, version or geometry
    TORN = "torn"  # a write never finished: the writer died or hangs in it


@dataclass(slots=True)
class StepRecord:
    """A consistent copy of a record (not frozen: one is made for every worker at every scrape)."""

    pid: int
    start_time_ticks: int
    seq: int
    steps: int
    finished: int
    latest: int | None  # None: the latest step's count could not be read
    latest_started_ns: int
    latest_finished_ns: int
    unreadable: int
    data: bytes  # the whole copy, buckets included

    @property
    def in_step(self) -> bool:
        return self.steps > self.finished

    def bucket(self, index: int) -> int:
        """The most any step ran in second `index` (`time_ns // BUCKET_NS`); 0 where its slot holds another."""
        held, most = BUCKET.unpack_from(self.data, _BUCKETS_AT + (index % BUCKET_COUNT) * BUCKET.size)
        return int(most) if held == index else 0

    def most_in(self, first: int, last: int) -> int:
        """The most any step ran in the seconds `first` to `last` (indices, at most the buckets held)."""
        return max((self.bucket(index) for index in range(max(first, last - BUCKET_COUNT + 1), last + 1)), default=0)


def read_consistent(read: Callable[[], bytes]) -> StepRecord | RecordProblem:
    """A consistent copy of a record, `read` giving a whole copy each call (the file's bytes, or a mapping's).

    Two copies taken one after the other that are equal, with an even `seq`, are consistent: every write changes
    `seq` twice, and a copy that caught a write's fields but not its `seq` (or the other way round) differs from the
    one taken after it. Nothing here depends on the order in which a copy reads its bytes (a kernel's `pread`
    copies them in whatever order it likes). A record that never settles on an even `seq` is `torn`.
    """
    for _ in range(READ_ATTEMPTS):
        first = read()
        if first == read():
            return decode(first)
    return RecordProblem.TORN


def decode(data: bytes) -> StepRecord | RecordProblem:
    """One copy's fields; `torn` where a write was in progress when it was taken."""
    if len(data) != RECORD_BYTES or not data.startswith(_GEOMETRY):
        return RecordProblem.INVALID
    pid, ticks, seq, steps, finished, latest, started, ended, unreadable = _STATE.unpack_from(data, _STATE_AT)
    if finished > steps:
        return RecordProblem.INVALID
    if seq & 1:
        return RecordProblem.TORN
    count = None if latest == UNKNOWN else latest
    return StepRecord(pid, ticks, seq, steps, finished, count, started, ended, unreadable, data)


class RecordWriter:
    """The writer's protocol in Python over a writable buffer (the demo's and the tests' workers; the hook's is the C
    helper, which writes the same bytes). One writer per record."""

    def __init__(self, view: memoryview | bytearray) -> None:
        if len(view) != RECORD_BYTES:
            raise ValueError(f"a step record is {RECORD_BYTES} bytes, got {len(view)}")
        self.view = view

    def begin(self, count: int | None, now_ns: int | None = None) -> None:
        now = time.monotonic_ns() if now_ns is None else now_ns
        seq, steps, finished, _, _, ended, unreadable = _COUNTERS.unpack_from(self.view, SEQ_OFFSET)
        _SEQ.pack_into(self.view, SEQ_OFFSET, seq + 1)
        latest = UNKNOWN if count is None else count
        _COUNTERS.pack_into(
            self.view, SEQ_OFFSET, seq + 1, steps + 1, finished, latest, now, ended, unreadable + (count is None)
        )
        if count is not None:
            self._bucket(now, count)
        _SEQ.pack_into(self.view, SEQ_OFFSET, seq + 2)

    def end(self, now_ns: int | None = None) -> None:
        now = time.monotonic_ns() if now_ns is None else now_ns
        seq, steps, finished, latest, started, _, unreadable = _COUNTERS.unpack_from(self.view, SEQ_OFFSET)
        _SEQ.pack_into(self.view, SEQ_OFFSET, seq + 1)
        _COUNTERS.pack_into(self.view, SEQ_OFFSET, seq + 1, steps, finished + 1, latest, started, now, unreadable)
        if latest != UNKNOWN:
            self._bucket(now, latest)
        _SEQ.pack_into(self.view, SEQ_OFFSET, seq + 2)

    def _bucket(self, now_ns: int, count: int) -> None:
        index = now_ns // BUCKET_NS
        offset = _BUCKETS_AT + (index % BUCKET_COUNT) * BUCKET.size
        held, most = BUCKET.unpack_from(self.view, offset)
        if held != index or count > most:
            BUCKET.pack_into(self.view, offset, index, count)
