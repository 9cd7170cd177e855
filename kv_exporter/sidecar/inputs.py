"""A scrape's inputs: the manifest folder, the engine pages, the GPU reader.

Each reader turns what it finds into records (`kv_exporter.sidecar.snapshot`'s `ManifestEntry`, `PageResult`,
`GpuResult`) and counts what went wrong by reason; none of them raises into the scrape.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace

from kv_exporter import filestat
from kv_exporter.filestat import FileSignature
from kv_exporter.gpu import GpuReader, GpuReadError
from kv_exporter.manifest import (
    DEFAULT_LIMITS,
    OBSERVATION_PROBLEM_REASONS,
    READER_ERROR_REASONS,
    Manifest,
    ManifestError,
    ManifestLimits,
    is_manifest_name,
    read_manifest,
)
from kv_exporter.observation import ObservationState
from kv_exporter.printable import printable
from kv_exporter.procfs import ProcessWatch
from kv_exporter.sidecar.engine_page import (
    ABOVE_MAX_NUM_SEQS,
    DEFAULT_MAX_PAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    INTERNAL_ERROR,
    PAGE_ERROR_REASONS,
    EngineKey,
    EnginePageError,
    EngineTarget,
    fetch_page,
    scan_page,
)
from kv_exporter.sidecar.liveness import State, Verdict, classify
from kv_exporter.sidecar.observed import FUTURE_TIMESTAMP, ObservedState, worker_state
from kv_exporter.sidecar.records import FolderState, GpuResult, ManifestEntry, PageResult, engine_key, placement
from kv_exporter.transport.fetch import Client, timed_out

log = logging.getLogger(__name__)

FOLDER_UNREADABLE = "folder_unreadable"
MANIFEST_ERROR_REASONS = (*READER_ERROR_REASONS, FOLDER_UNREADABLE)
# Observations refused by the sidecar rather than by the reader: one from a process that is gone, a sample too old.
DEAD_PROCESS = "dead_process"
OBSERVATION_ERROR_REASONS = (*OBSERVATION_PROBLEM_REASONS, DEAD_PROCESS, ObservedState.STALE.value, FUTURE_TIMESTAMP)


class ManifestStore:
    """Reads the manifest folder, caching each parse by its file signature; counts each bad version once.

    Every entry with a manifest's name is read, whatever it is: one that is not a regular file (a FIFO, a device, a
    socket, a directory) is refused with a reason and counted, never skipped in silence; `read_manifest` opens
    without blocking, so none can hold a scrape. An entry that is gone by the time it is read is simply gone.
    """

    def __init__(self, directory: str, limits: ManifestLimits = DEFAULT_LIMITS) -> None:
        self.directory = directory
        self.limits = limits
        self._cache: dict[str, tuple[FileSignature, Manifest | ManifestError]] = {}
        self.errors_total: Counter[str] = Counter(dict.fromkeys(MANIFEST_ERROR_REASONS, 0))
        self.folder_error: str | None = None
        self.folder_state = FolderState.OK

    def load(self) -> list[tuple[str, Manifest | ManifestError]]:
        """Every manifest file, sorted by path, parsed or with its error."""
        seen: dict[str, tuple[FileSignature, Manifest | ManifestError]] = {}
        for path, signature in self._listing():
            cached = self._cache.get(path)
            if cached and cached[0] == signature:
                seen[path] = cached
            elif (parsed := self._parse(path)) is not None:
                seen[path] = (signature, parsed)
        self._cache = seen
        return [(path, result) for path, (_, result) in sorted(seen.items())]

    def _listing(self) -> Iterator[tuple[str, FileSignature]]:
        try:
            entries = list(os.scandir(self.directory))
        except OSError as exc:
            self.folder_state = folder_state(self.directory, exc)
            self._folder_failed(printable(f"{exc.strerror or exc}"))
            return
        self.folder_state = FolderState.OK
        self._folder_failed(None)
        for entry in entries:
            if not is_manifest_name(entry.name):
                continue
            try:
                st = entry.stat()
            except OSError:
                try:
                    st = entry.stat(follow_symlinks=False)  # a link that cannot be followed: reading says why
                except OSError:
                    continue  # removed between listing and stat: it is simply gone
            yield entry.path, filestat.signature(st)

    def _folder_failed(self, error: str | None) -> None:
        if error is not None and self.folder_error is None:
            log.warning("manifest folder %s unreadable: %s", printable(self.directory), error)
            self.errors_total[FOLDER_UNREADABLE] += 1
        self.folder_error = error

    def _parse(self, path: str) -> Manifest | ManifestError | None:
        """The manifest, or why not (counted and logged once per file version: the cache keeps it until the file
        changes); None when the file is gone."""
        try:
            return read_manifest(path, self.limits)
        except FileNotFoundError:
            return None
        except ManifestError as exc:
            log.warning("invalid manifest %s", exc)
            self.errors_total[exc.reason] += 1
            return exc


def folder_state(directory: str, error: OSError) -> FolderState:
    """Why listing `directory` failed, as the folder-state gauge names it."""
    if isinstance(error, FileNotFoundError):
        return FolderState.MISSING
    if isinstance(error, NotADirectoryError):  # the path itself, or a folder on the way to it, is something else
        return FolderState.NOT_A_FOLDER if os.path.lexists(directory) else FolderState.MISSING
    return FolderState.UNREADABLE


class ObservationAccount:
    """Counts the observations that are refused rather than exported, each once: an unreadable one or one from a
    dead process once per file version, a stale one once per sample."""

    def __init__(self) -> None:
        self.errors_total: Counter[str] = Counter(dict.fromkeys(OBSERVATION_ERROR_REASONS, 0))
        self._counted: set[tuple[str, str, float]] = set()

    def account(self, entries: Sequence[ManifestEntry], now: float) -> None:
        refused = {key for key in (_refusal(entry, now) for entry in entries) if key is not None}
        for path, reason, _ in sorted(refused - self._counted):
            log.warning("observation in %s refused: %s", printable(path), reason)
            self.errors_total[reason] += 1
        self._counted = refused


def _refusal(entry: ManifestEntry, now: float) -> tuple[str, str, float] | None:
    m = entry.manifest
    if m is None:
        return None
    problem = m.observation_problem or m.allocator_problem
    if problem is not None:
        return entry.path, problem.reason, m.written_at
    if m.observation is None or m.observation.state is not ObservationState.OK:
        return None
    if not entry.live:
        return entry.path, DEAD_PROCESS, m.written_at
    state = worker_state(m, now)
    if state is ObservedState.REJECTED:  # the one way a readable observation is rejected: dated ahead
        return entry.path, FUTURE_TIMESTAMP, m.observation.taken_at
    if state is ObservedState.STALE:
        return entry.path, ObservedState.STALE.value, m.observation.taken_at
    return None


def assess(
    loaded: Sequence[tuple[str, Manifest | ManifestError]],
    our_namespace: str | None,
    proc: str = "/proc",
    watch: ProcessWatch | None = None,
) -> list[ManifestEntry]:
    valid = [(path, item) for path, item in loaded if isinstance(item, Manifest)]
    verdicts = classify(valid, our_namespace, proc, watch)
    entries = []
    for path, item in loaded:
        if isinstance(item, Manifest):
            entries.append(ManifestEntry(path, item, verdicts[path]))
        else:
            entries.append(ManifestEntry(path, None, Verdict(State.INVALID, item.reason), item))
    return entries


class EnginePages:
    """Reads every engine page concurrently in the calling thread, on an event loop of its own, with one connection
    kept open per engine between scrapes. `begin` sends the requests (at once on a kept connection), so the engines
    answer while the caller does other work; `finish` waits for the answers, all within one engine deadline from then.
    One begin-finish at a time (the collection's single flight)."""

    def __init__(
        self,
        targets: Sequence[EngineTarget],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_bytes: int = DEFAULT_MAX_PAGE_BYTES,
    ) -> None:
        self.targets = tuple(targets)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._loop = asyncio.new_event_loop()
        self._client = Client()
        self._scan_deadline = 0.0
        self._waiting_since = 0.0
        zeros = ((t.target, reason) for t in self.targets for reason in PAGE_ERROR_REASONS)
        self.errors_total: Counter[tuple[str, str]] = Counter(dict.fromkeys(zeros, 0))
        self._last_reason: dict[str, str | None] = {}

    def read_all(self) -> list[PageResult]:
        return self.finish(self.begin())

    def begin(self) -> list[asyncio.Task[PageResult]]:
        if not self.targets:  # no engine to read: no turn of the loop either
            return []
        self._scan_deadline = time.monotonic() + self.timeout_s
        self._waiting_since = time.perf_counter()  # for a read that ends here (none has data yet, one may fail)
        reads = [self._loop.create_task(self._read(target)) for target in self.targets]
        self._loop.run_until_complete(asyncio.sleep(0))  # each read runs to its first wait: its request is out
        return reads

    def finish(
        self, reads: list[asyncio.Task[PageResult]], limits: dict[EngineKey, int] | None = None
    ) -> list[PageResult]:
        """The pages; an engine's running count above its limit (`limits`: the live manifests' max_num_seqs) is
        impossible: left out of its page (the engine reads as unreadable) and counted."""
        if not reads:
            return []
        results = self._loop.run_until_complete(self._answers(reads))
        results = [_refuse_impossible(result, limits or {}) for result in results]
        for result in results:
            self._account(result)
        return results

    async def _answers(self, reads: list[asyncio.Task[PageResult]]) -> list[PageResult]:
        # The deadline starts now, not at `begin`: the caller's own work in between is not the engines' time.
        self._waiting_since = time.perf_counter()
        self._scan_deadline = time.monotonic() + self.timeout_s
        _, pending = await asyncio.wait(reads, timeout=self.timeout_s) if reads else (set(), set())
        for read in pending:
            read.cancel()
        if pending:
            await asyncio.wait(pending)  # each closes its connection
        answers = zip(self.targets, reads, strict=True)
        return [self._late(target) if read.cancelled() else read.result() for target, read in answers]

    async def _read(self, target: EngineTarget) -> PageResult:
        try:
            data = await fetch_page(self._client, target, self.max_bytes)
            return PageResult(target.target, scan_page(data, self._scan_deadline), None, self._waited())
        except EnginePageError as exc:
            # Kept without its traceback: its frames hold what was read (up to --engine-max-bytes), and this frame
            # holding `exc` would make a cycle that only the cyclic GC frees (+4 MiB of RSS a scrape of a 50 MB page).
            error = exc.with_traceback(None)
        except Exception as exc:  # a bug must not take the exporter down: report it like a bad page
            log.exception("engine page %s: unexpected error", target.target)
            error = EnginePageError(INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
        return PageResult(target.target, None, error, self._waited())

    def _waited(self) -> float:
        """How long the collection has waited for the engines: what a page cost the scrape (the time it took while
        the collection read its manifests cost nothing)."""
        return max(0.0, time.perf_counter() - self._waiting_since)

    def _late(self, target: EngineTarget) -> PageResult:
        late = timed_out(self.timeout_s)
        return PageResult(target.target, None, EnginePageError(late.reason, late.detail), self.timeout_s)

    def _account(self, result: PageResult) -> None:
        reason = result.error.reason if result.error else ABOVE_MAX_NUM_SEQS if result.refused else None
        if reason is not None:
            self.errors_total[(result.target, reason)] += 1
        if self._last_reason.get(result.target, "") != reason:  # log transitions, not every scrape
            if result.error:
                log.warning("engine page %s: %s", result.target, result.error)
            elif result.refused:
                shown = ", ".join(f"{k.model_name} stage {k.stage} engine {k.engine}" for k in result.refused)
                log.warning("engine page %s: a running count above max_num_seqs, not used (%s)", result.target, shown)
            elif result.target in self._last_reason:
                log.info("engine page %s: readable again", result.target)
        self._last_reason[result.target] = reason

    def close(self) -> None:
        """Close the kept connections and the loop; a collection still reading (stuck) keeps them, to the exit."""
        if not self._loop.is_running():
            self._client.close()
            self._loop.close()


def _refuse_impossible(result: PageResult, limits: dict[EngineKey, int]) -> PageResult:
    refused = () if result.page is None else result.page.above(limits)
    if not refused or result.page is None:
        return result
    return replace(result, page=result.page.without(refused), refused=refused)


def running_limits(entries: Sequence[ManifestEntry]) -> dict[EngineKey, int]:
    """Each engine's max_num_seqs, as its live manifests give it: no running count can pass it."""
    limits: dict[EngineKey, int] = {}
    for entry in entries:
        m = entry.manifest
        if m is not None and entry.live:
            key = engine_key(m)
            limits[key] = max(limits.get(key, 0), m.max_num_seqs)
    return limits


def read_gpus(reader: GpuReader | None, entries: Sequence[ManifestEntry]) -> GpuResult:
    if reader is None:
        return GpuResult(enabled=False, source=None)
    try:
        scan = reader.scan()
    except GpuReadError as exc:
        return GpuResult(enabled=True, source=reader.source, error=exc)
    processes: dict[int, dict[int, int]] = {}
    comparable: set[int] = set()
    errors = list(scan.errors)
    read = GpuResult(True, reader.source, scan.devices)  # where each manifest is placed, by the one rule
    for device in scan.devices:
        mine = [e for e in entries if e.live and e.manifest is not None and placement(e.manifest, read).on(device)]
        if not mine:
            continue  # only the GPUs a live manifest sits on: whose processes the projection must account for
        if any(_comparable_pid(e, reader) for e in mine):
            comparable.add(device.index)
        try:
            processes[device.index] = reader.process_memory(device.index)
        except GpuReadError as exc:
            errors.append(exc)
    return GpuResult(True, reader.source, scan.devices, processes, frozenset(comparable), None, tuple(errors))


def _comparable_pid(entry: ManifestEntry, reader: GpuReader) -> bool:
    m = entry.manifest
    return m is not None and m.process.pid_namespace is not None and m.process.pid_namespace == reader.pid_namespace
