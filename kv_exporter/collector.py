"""The sidecar's collector: gathers one scrape's inputs, shares the collection, and feeds prometheus_client.

Data flows one way. Each scrape:
  1. `ManifestStore.load` lists the manifest folder; a file is re-parsed only when its stat changes.
  2. `liveness.classify` marks each valid manifest live or stale.
  3. `EnginePages.read_all` fetches every configured engine page in parallel (one fetch per engine).
  4. The GPU reader (NVML or simulated) gives per-GPU memory, and per-process memory where pids compare.
  5. `snapshot.build_snapshot` (pure) combines them; `families.families` turns a snapshot into metric families.
Concurrent scrapes share one collection (`SingleFlight`). Nothing runs between scrapes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kv_exporter.engine_page import (
    DEFAULT_MAX_PAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    EnginePageError,
    EngineTarget,
    read_engine,
)
from kv_exporter.families import families
from kv_exporter.liveness import State, Verdict, classify
from kv_exporter.manifest import (
    DEFAULT_LIMITS,
    Manifest,
    ManifestError,
    ManifestLimits,
    current_pid_namespace,
    is_manifest_name,
    read_manifest,
)
from kv_exporter.nvml import GpuMemory, GpuReader, GpuReadError
from kv_exporter.snapshot import (
    DEFAULT_MAX_SERIES,
    GpuResult,
    ManifestEntry,
    PageResult,
    Snapshot,
    build_snapshot,
    on_device,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


# -- inputs ------------------------------------------------------------------------------------------------


# inode, mtime, ctime, size. The change time catches what the others miss: a chmod that makes a file readable, and
# an in-place rewrite that restores the old mtime (cp -p, rsync -t, tar); nothing can set it back.
_Signature = tuple[int, int, int, int]


class ManifestStore:
    """Reads the manifest folder, caching each file's parse by its signature; counts each bad version once."""

    def __init__(self, directory: str, limits: ManifestLimits = DEFAULT_LIMITS) -> None:
        self.directory = directory
        self.limits = limits
        self._cache: dict[str, tuple[_Signature, Manifest | ManifestError]] = {}
        self.errors_total: Counter[str] = Counter()
        self.folder_error: str | None = None

    def load(self) -> list[tuple[str, Manifest | ManifestError]]:
        """Every manifest file, sorted by path, parsed or with its error."""
        seen: dict[str, tuple[_Signature, Manifest | ManifestError]] = {}
        for path, signature in self._listing():
            cached = self._cache.get(path)
            seen[path] = cached if cached and cached[0] == signature else (signature, self._parse(path))
        self._cache = seen
        return [(path, result) for path, (_, result) in sorted(seen.items())]

    def _listing(self) -> Iterator[tuple[str, _Signature]]:
        try:
            entries = list(os.scandir(self.directory))
        except OSError as exc:
            self._folder_failed(f"{exc.strerror or exc}")
            return
        self._folder_failed(None)
        for entry in entries:
            if not is_manifest_name(entry.name):
                continue
            try:
                st = entry.stat()
            except OSError:
                continue  # removed between listing and stat: it is simply gone
            if entry.is_file():
                yield entry.path, (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)

    def _folder_failed(self, error: str | None) -> None:
        if error is not None and self.folder_error is None:
            log.warning("manifest folder %s unreadable: %s", self.directory, error)
            self.errors_total["folder_unreadable"] += 1
        self.folder_error = error

    def _parse(self, path: str) -> Manifest | ManifestError:
        try:
            return read_manifest(path, self.limits)
        except ManifestError as exc:
            # Once per file version: the cache keeps this result until the file changes.
            log.warning("invalid manifest %s", exc)
            self.errors_total[exc.reason] += 1
            return exc


def assess(
    loaded: Sequence[tuple[str, Manifest | ManifestError]], our_namespace: str | None, proc: str = "/proc"
) -> list[ManifestEntry]:
    valid = [(path, item) for path, item in loaded if isinstance(item, Manifest)]
    verdicts = classify(valid, our_namespace, proc)
    entries = []
    for path, item in loaded:
        if isinstance(item, Manifest):
            entries.append(ManifestEntry(path, item, verdicts[path]))
        else:
            entries.append(ManifestEntry(path, None, Verdict(State.INVALID, item.reason), item))
    return entries


class EnginePages:
    """Fetches every engine page in parallel, one request per engine per call."""

    def __init__(
        self,
        targets: Sequence[EngineTarget],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_bytes: int = DEFAULT_MAX_PAGE_BYTES,
    ) -> None:
        self.targets = tuple(targets)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        workers = max(1, min(32, len(self.targets)))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engine-page")
        self.errors_total: Counter[tuple[str, str]] = Counter()
        self._last_reason: dict[str, str | None] = {}

    def read_all(self) -> list[PageResult]:
        futures = [self._pool.submit(self._read, target) for target in self.targets]
        results = [future.result() for future in futures]
        for result in results:
            self._account(result)
        return results

    def _read(self, target: EngineTarget) -> PageResult:
        started = time.perf_counter()
        try:
            page = read_engine(target, self.timeout_s, self.max_bytes)
            return PageResult(target.target, page, None, time.perf_counter() - started)
        except EnginePageError as exc:
            # Kept without its traceback: its frames hold what was read (up to --engine-max-bytes), and this frame
            # holding `exc` would make a cycle that only the cyclic GC frees (+4 MiB of RSS a scrape of a 50 MB page).
            return PageResult(target.target, None, exc.with_traceback(None), time.perf_counter() - started)
        except Exception as exc:  # a bug must not take the exporter down: report it like a bad page
            log.exception("engine page %s: unexpected error", target.target)
            error = EnginePageError("internal_error", f"{type(exc).__name__}: {exc}"[:200])
            return PageResult(target.target, None, error, time.perf_counter() - started)

    def _account(self, result: PageResult) -> None:
        reason = result.error.reason if result.error else None
        if reason is not None:
            self.errors_total[(result.target, reason)] += 1
        if self._last_reason.get(result.target, "") != reason:  # log transitions, not every scrape
            if result.error:
                log.warning("engine page %s: %s", result.target, result.error)
            elif result.target in self._last_reason:
                log.info("engine page %s: readable again", result.target)
        self._last_reason[result.target] = reason

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def read_gpus(reader: GpuReader | None, entries: Sequence[ManifestEntry]) -> GpuResult:
    if reader is None:
        return GpuResult(enabled=False, source=None)
    try:
        scan = reader.scan()
    except GpuReadError as exc:
        return GpuResult(enabled=True, source=reader.source, error=exc)
    processes: dict[int, dict[int, int]] = {}
    errors = list(scan.errors)
    for device in scan.devices:
        if not any(_comparable_pid(e, reader, device) for e in entries):
            continue  # only read per-process figures where a live manifest can be matched
        try:
            processes[device.index] = reader.process_memory(device.index)
        except GpuReadError as exc:
            errors.append(exc)
    return GpuResult(True, reader.source, scan.devices, processes, None, tuple(errors))


def _comparable_pid(entry: ManifestEntry, reader: GpuReader, device: GpuMemory) -> bool:
    m = entry.manifest
    return (
        entry.live
        and m is not None
        and on_device(m, device)
        and m.process.pid_namespace is not None
        and m.process.pid_namespace == reader.pid_namespace
    )


# -- collection, shared by concurrent scrapes ----------------------------------------------------------------


class SingleFlight(Generic[T]):
    """Calls `fn` for the first caller; callers arriving while it runs wait and get the same result."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._flight: _Flight[T] | None = None

    def __call__(self) -> T:
        with self._lock:
            flight = self._flight
            leader = flight is None
            if flight is None:
                flight = self._flight = _Flight()
        if leader:
            try:
                flight.result = self._fn()
            except BaseException as exc:
                flight.error = exc
                raise
            finally:
                with self._lock:
                    self._flight = None
                flight.done.set()
            return flight.result
        flight.done.wait()
        if flight.error is not None:
            raise flight.error
        assert flight.result is not None
        return flight.result


class _Flight(Generic[T]):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


@dataclass(frozen=True)
class Settings:
    manifest_dir: str
    targets: tuple[EngineTarget, ...] = ()
    fetch_timeout_s: float = DEFAULT_TIMEOUT_S
    max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES
    manifest_limits: ManifestLimits = DEFAULT_LIMITS
    max_series: int = DEFAULT_MAX_SERIES
    proc: str = "/proc"


class Collection:
    """Everything one scrape needs, gathered once per scrape (single-flight) into a Snapshot."""

    def __init__(self, settings: Settings, gpu_reader: GpuReader | None, our_namespace: str | None = None):
        self.settings = settings
        self.gpu_reader = gpu_reader
        self.our_namespace = current_pid_namespace() if our_namespace is None else our_namespace
        self.store = ManifestStore(settings.manifest_dir, settings.manifest_limits)
        self.pages = EnginePages(settings.targets, settings.fetch_timeout_s, settings.max_page_bytes)
        self.nvml_errors_total: Counter[str] = Counter()
        self._last_nvml_error: str | None = None
        self._last_dropped: tuple[str, ...] = ()
        self.snapshot = SingleFlight(self._collect)

    def _collect(self) -> Snapshot:
        started = time.perf_counter()
        entries = assess(self.store.load(), self.our_namespace, self.settings.proc)
        # Not overlapped with the manifest work above: the fetch threads then fight this thread for the GIL, which
        # cost more CPU (4.6 vs 4.0 ms a scrape, 3x the context switches) than the overlap saved (docs/benchmarks.md).
        pages = self.pages.read_all()
        gpu = read_gpus(self.gpu_reader, entries)
        self._account_gpu(gpu)
        snapshot = build_snapshot(
            entries,
            pages,
            gpu,
            max_series=self.settings.max_series,
            manifest_folder=self.settings.manifest_dir,
            manifest_folder_error=self.store.folder_error,
            manifest_errors_total=dict(self.store.errors_total),
            page_errors_total=dict(self.pages.errors_total),
            nvml_errors_total=dict(self.nvml_errors_total),
            duration_s=time.perf_counter() - started,
            taken_at=time.time(),
        )
        self._account_series(snapshot.series_dropped)
        return snapshot

    def _account_series(self, dropped: tuple[str, ...]) -> None:
        """Log when the set of manifests left out by the series cap changes, not on every scrape."""
        if dropped != self._last_dropped:
            if dropped:
                shown = ", ".join(dropped[:3]) + (f" and {len(dropped) - 3} more" if len(dropped) > 3 else "")
                log.warning(
                    "series cap (--max-series %d) reached: %d live manifest(s) left out, newest first: %s",
                    self.settings.max_series, len(dropped), shown,
                )  # fmt: skip
            else:
                log.info("series cap no longer reached: every live manifest is exported")
            self._last_dropped = dropped

    def _account_gpu(self, gpu: GpuResult) -> None:
        errors = ([gpu.error] if gpu.error else []) + list(gpu.device_errors)
        for error in errors:
            self.nvml_errors_total[error.reason] += 1
        summary = "; ".join(str(e) for e in errors) or None
        if summary != self._last_nvml_error:
            if summary:
                log.warning("GPU reader (%s): %s", gpu.source, summary)
            self._last_nvml_error = summary

    def close(self) -> None:
        self.pages.close()


class KVCollector(Collector):
    """The prometheus_client collector: everything is computed at scrape time from one shared collection."""

    def __init__(self, collection: Collection) -> None:
        self.collection = collection

    def collect(self) -> Iterable[Metric]:
        return families(self.collection.snapshot())
