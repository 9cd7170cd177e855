"""What each worker runs, from its step record (kv_exporter/steprecord.py), judged at the scrape.

Per worker: the sequences running now (the latest step's, while it runs and for `RECENT_S` after it ends: the gap
between two steps is the engine's own scheduling; past it, nothing runs) and the most any step ran over the last
`--running-window` seconds. Per engine: the most of its workers' (tensor-parallel ranks run the same batch).

Records are read with `pread`, two copies at a time (`read_consistent`), never mapped: a mapped file that someone
truncates would kill the reader with SIGBUS, where a short read costs one worker's figures. A descriptor stays open
per record (up to `records_kept_open()`, from the descriptor limit; past that a record is opened for each read) and
is opened again when the manifest's process is not the record's (a restarted worker replaces both files).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import NamedTuple

from kv_exporter.manifest import Manifest
from kv_exporter.printable import printable
from kv_exporter.sidecar.engine_page import EngineKey
from kv_exporter.sidecar.records import ManifestEntry, engine_key
from kv_exporter.steprecord import (
    BUCKET_COUNT,
    BUCKET_NS,
    RECORD_BYTES,
    RecordProblem,
    StepRecord,
    read_consistent,
    record_name,
)

log = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 15.0  # the scrape interval operators use most
MAX_WINDOW_S = 120.0  # what a record's buckets hold, less one
RECENT_S = 1.0  # a step that ended this long ago still runs "now"; past it the worker is idle
STALL_AFTER_S = 60.0  # one step running this long: the process lives, its steps have stopped
TORN_AFTER_S = 1.0  # a write this long in progress: its writer died or hangs in it
RETRY_S = 1.0  # how often a missing record is looked for again
SETTLE_NS = 50_000_000  # past a second's end by this, its bucket is final: the writer's coarse clock lags a tick
_RECENT_NS, _STALL_NS, _TORN_NS = (int(s * 1e9) for s in (RECENT_S, STALL_AFTER_S, TORN_AFTER_S))
MAX_OPEN = 512  # descriptors kept open at the least
# What the rest of the process may hold at once: the server's connections (512 by default), manifests being read.
OTHER_DESCRIPTORS = 1024


class RunningState(str, Enum):
    """Where a worker's (an engine's: the worst of its workers') running count stands. A metric label."""

    STEPPING = "stepping"  # a step runs, or ended within RECENT_S: its sequences run
    IDLE = "idle"  # no step since RECENT_S (or none yet): nothing runs
    STALLED = "stalled"  # one step has run for STALL_AFTER_S: its sequences are held, its steps have stopped
    UNREADABLE = "unreadable"  # the writer could not read the latest step's count
    TORN = "torn"  # a write stayed unfinished: the writer died or hangs in it
    INVALID = "invalid"  # not a record of this version, or a count above the engine's max_num_seqs
    ABSENT = "absent"  # no record of this process (a writer without one): the engine's page, where configured


WORST_FIRST = (
    RunningState.INVALID,
    RunningState.TORN,
    RunningState.UNREADABLE,
    RunningState.STALLED,
    RunningState.ABSENT,
    RunningState.STEPPING,
    RunningState.IDLE,
)


class Running(NamedTuple):
    """Sequences running now and the most over the window; None where unknown."""

    state: RunningState
    latest: int | None = None
    most: int | None = None


ABSENT = Running(RunningState.ABSENT)


def judge(record: StepRecord, now_ns: int, most: int, max_num_seqs: int) -> Running:
    """A worker's running count at `now_ns` (CLOCK_MONOTONIC), from a consistent record and the most its buckets
    hold over the window (`_Buckets.most`)."""
    if record.in_step:
        ran_for = now_ns - record.latest_started_ns
        state = RunningState.STALLED if ran_for >= _STALL_NS else RunningState.STEPPING
        latest = record.latest
    elif record.steps and now_ns - record.latest_finished_ns <= _RECENT_NS:
        state, latest = RunningState.STEPPING, record.latest
    else:
        state, latest = RunningState.IDLE, 0
    if latest is None:
        return Running(RunningState.UNREADABLE, None, most)
    most = max(most, latest)
    if most > max_num_seqs:  # no step runs more than its engine's max_num_seqs
        return Running(RunningState.INVALID)
    return Running(state, latest, most)


class _Buckets:
    """A record's buckets over the window, kept between reads: a second the writer can no longer write (its clock is
    coarse: SETTLE_NS after its end) is read once, so a read looks at the seconds since the last one, not the
    whole window."""

    __slots__ = ("settled", "through", "top")

    def __init__(self) -> None:
        self.settled: list[tuple[int, int]] = []  # (second, most) of settled seconds with a step, oldest first
        self.through = -1  # the last second read as settled
        self.top = 0  # the most of `settled`

    def most(self, record: StepRecord, now_ns: int, window_ns: int) -> int:
        first, now = (now_ns - window_ns) // BUCKET_NS, now_ns // BUCKET_NS
        settled = (now_ns - SETTLE_NS) // BUCKET_NS - 1
        for second in range(max(first, self.through + 1, settled - BUCKET_COUNT + 1), settled + 1):
            if most := record.bucket(second):
                self.settled.append((second, most))
                self.top = max(self.top, most)
        self.through = max(self.through, settled)
        if self.settled and self.settled[0][0] < first:
            self.settled = [kept for kept in self.settled if kept[0] >= first]
            self.top = max((most for _, most in self.settled), default=0)
        recent = self.top
        for second in range(max(first, settled + 1), now + 1):  # the one or two seconds still written
            recent = max(recent, record.bucket(second))
        return recent


def engine_running(workers: Iterable[Running]) -> Running:
    """An engine's: the most its workers run (tensor-parallel ranks run the same batch), in their worst state."""
    workers = list(workers)
    states = {w.state for w in workers}
    state = next(s for s in WORST_FIRST if s in states)
    latest = [w.latest for w in workers if w.latest is not None]
    most = [w.most for w in workers if w.most is not None]
    return Running(state, max(latest) if latest else None, max(most) if most else None)


class _Open:
    __slots__ = ("buckets", "fd", "last_good", "path", "since_torn", "torn_seq")

    def __init__(self, path: str, fd: int | None) -> None:
        self.path = path
        self.fd = fd  # None: opened for each read
        self.buckets = _Buckets()
        self.last_good: StepRecord | None = None
        self.since_torn = 0.0
        self.torn_seq = -1


def records_kept_open(soft_limit: int | None = None) -> int:
    """How many records keep their descriptor open: what the soft RLIMIT_NOFILE (`soft_limit`: the process's own)
    leaves past OTHER_DESCRIPTORS, MAX_OPEN at the least. A record past it is opened, read and closed at every scrape:
    at 1,667 workers with 512 kept open, step records cost twice the CPU a worker that 100 workers cost."""
    if soft_limit is None:
        soft_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_limit == resource.RLIM_INFINITY:
        return 1 << 30
    return max(MAX_OPEN, soft_limit - OTHER_DESCRIPTORS)


class StepRecords:
    """The step records of the live manifests, read at each scrape. One reader per collection; `kept_open`: how many
    records keep a descriptor (default `records_kept_open()`)."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, kept_open: int | None = None) -> None:
        self.window_ns = int(window_s * 1e9)
        self.kept_open = records_kept_open() if kept_open is None else kept_open
        self._open: dict[str, _Open] = {}  # manifest path -> its record
        self._missing: dict[str, float] = {}  # manifest path -> when its record was last looked for
        self._problems: dict[str, RunningState] = {}  # the last problem logged per manifest path

    def read(self, entries: Sequence[ManifestEntry]) -> dict[str, Running]:
        """Each live manifest's worker, by manifest path."""
        now_ns = time.monotonic_ns()
        result: dict[str, Running] = {}
        for entry in entries:
            if entry.live and entry.manifest is not None:
                result[entry.path] = self._worker(entry.path, entry.manifest, now_ns)
        for path in [p for p in self._open if p not in result]:
            self._close(path)
        self._missing = {p: t for p, t in self._missing.items() if p in result}
        return result

    def _worker(self, path: str, manifest: Manifest, now_ns: int) -> Running:
        found = self._open.get(path)
        if found is None:
            looked = self._missing.get(path)
            if looked is not None and now_ns - looked < RETRY_S * 1e9:
                return ABSENT
            found = self._opened(path)
            if found is None:
                self._missing[path] = now_ns
                return ABSENT
        record = self._read(found, now_ns)
        process = manifest.process
        if isinstance(record, StepRecord) and (record.pid, record.start_time_ticks) != (
            process.pid,
            process.start_time_ticks or 0,
        ):  # another process's: an earlier worker's, or this one has not made its own yet
            self._close(path)
            self._missing[path] = now_ns
            return ABSENT
        if isinstance(record, RecordProblem):
            running = Running(RunningState(record.value))
        else:
            most = found.buckets.most(record, now_ns, self.window_ns)
            running = judge(record, now_ns, most, manifest.max_num_seqs)
        self._account(path, running.state)
        return running

    def _opened(self, path: str) -> _Open | None:
        folder, name = os.path.split(path)
        record_path = os.path.join(folder, record_name(name))
        fd = _open(record_path)
        if fd is None:
            return None
        if len(self._open) >= self.kept_open:  # read through a descriptor opened each time
            os.close(fd)
            fd = None
        found = self._open[path] = _Open(record_path, fd)
        return found

    def _read(self, found: _Open, now_ns: int) -> StepRecord | RecordProblem:
        """A consistent copy; a write seen in progress is `torn` only once it has lasted TORN_AFTER_S (a writer
        descheduled in the middle of one is not dead): until then, the last good copy."""
        fd = found.fd if found.fd is not None else _open(found.path)
        try:
            record = read_consistent(lambda: _pread(fd))
        finally:
            if found.fd is None and fd is not None:
                os.close(fd)
        if isinstance(record, StepRecord):
            found.last_good, found.torn_seq = record, -1
            return record
        if record is not RecordProblem.TORN or found.last_good is None:
            return record
        if found.torn_seq != found.last_good.seq:
            found.torn_seq, found.since_torn = found.last_good.seq, now_ns
        return record if now_ns - found.since_torn >= _TORN_NS else found.last_good

    def _close(self, path: str) -> None:
        found = self._open.pop(path, None)
        if found is not None and found.fd is not None:
            os.close(found.fd)

    def _account(self, path: str, state: RunningState) -> None:
        """Log a record's problem when it starts and when it ends, not on every scrape."""
        problem = state if state in (RunningState.TORN, RunningState.INVALID, RunningState.STALLED) else None
        last = self._problems.get(path)
        if problem is last:
            return
        if problem is not None:
            log.warning("step record of %s: %s", printable(path), problem.value)
            self._problems[path] = problem
        else:
            log.info("step record of %s: %s again", printable(path), state.value)
            del self._problems[path]

    def close(self) -> None:
        for path in list(self._open):
            self._close(path)


def _open(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO put there must not block
    except OSError:
        return None


def _pread(fd: int | None) -> bytes:
    try:
        return os.pread(fd, RECORD_BYTES + 1, 0) if fd is not None else b""
    except OSError:
        return b""


def engines_running(entries: Sequence[ManifestEntry], workers: dict[str, Running]) -> dict[EngineKey, Running]:
    """Each engine's running count from the records of its live workers that have one; ABSENT where none has."""
    by_engine: dict[EngineKey, list[Running]] = {}
    for entry in entries:
        worker = workers.get(entry.path)
        if entry.manifest is not None and worker is not None:
            recorded = by_engine.setdefault(engine_key(entry.manifest), [])
            if worker.state is not RunningState.ABSENT:
                recorded.append(worker)
    return {key: engine_running(recorded) if recorded else ABSENT for key, recorded in by_engine.items()}
