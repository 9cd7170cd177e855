"""One collection per scrape, shared by concurrent scrapes, and the prometheus_client collector over it.

Data flows one way. Each scrape:
  1. `ManifestStore.load` lists the manifest folder; a file is re-parsed only when its stat changes.
  2. `liveness.classify` marks each valid manifest live or stale.
  3. `EnginePages` fetches every configured engine page concurrently (none by default), its requests sent before
     step 1 (one fetch per engine, on a connection kept open between scrapes).
  4. `StepRecords` reads each live worker's step record: what it runs now and the most over the window.
  5. The GPU reader (NVML or simulated) gives per-GPU memory, and per-process memory where pids compare.
  6. `snapshot.build_snapshot` (pure) combines them; `families.families` turns a snapshot into metric families.
Concurrent scrapes share one collection (`SingleFlight`). Nothing runs between scrapes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kv_exporter.gpu import NVML_ERROR_REASONS, SOURCE_NVML, GpuReader
from kv_exporter.manifest import DEFAULT_LIMITS, ManifestLimits
from kv_exporter.printable import printable
from kv_exporter.procfs import ProcessWatch, current_pid_namespace
from kv_exporter.sidecar.allocator import return_free_memory
from kv_exporter.sidecar.budget import DEFAULT_MAX_LABEL_BYTES, DEFAULT_MAX_SERIES, SeriesCap
from kv_exporter.sidecar.declared import DeclaredCache
from kv_exporter.sidecar.engine_page import DEFAULT_MAX_PAGE_BYTES, DEFAULT_TIMEOUT_S, EngineTarget
from kv_exporter.sidecar.families import DeclarationFamilies, families
from kv_exporter.sidecar.inputs import (
    EnginePages,
    ManifestStore,
    ObservationAccount,
    assess,
    read_gpus,
    running_limits,
)
from kv_exporter.sidecar.records import GpuResult
from kv_exporter.sidecar.running import DEFAULT_WINDOW_S, StepRecords, engines_running
from kv_exporter.sidecar.snapshot import Snapshot, build_snapshot

log = logging.getLogger(__name__)

T = TypeVar("T")


class FlightTimeout(RuntimeError):
    """The shared call has run past its deadline: its waiters stop waiting (the call itself cannot be stopped)."""


class SingleFlight(Generic[T]):
    """Calls `fn` for the first caller; callers arriving while it runs wait and get the same result.

    The first caller runs `fn` itself: handing it to a thread of its own cost two thread hand-offs a scrape, 0.35 ms of
    2.9 (docs/decisions/0017-no-collection-thread.md). With `deadline_s`, the callers that join wait at most until the
    call has run that long, then get `FlightTimeout`; a call stuck in a read that never returns holds its first caller
    only (the server answers that caller's request at the deadline: `http.ExporterServer`). Callers join it until it
    returns, so a stuck call never runs twice at once.
    """

    def __init__(self, fn: Callable[[], T], deadline_s: float | None = None) -> None:
        self._fn = fn
        self._deadline_s = deadline_s
        self._lock = threading.Lock()
        self._flight: _Flight[T] | None = None

    def __call__(self) -> T:
        with self._lock:
            flight = self._flight
            if flight is None:
                flight = self._flight = _Flight()
                leader = True
            else:
                leader = False
        if leader:
            self._fly(flight)
        else:
            wait = None if self._deadline_s is None else max(0.0, flight.started + self._deadline_s - time.monotonic())
            if not flight.done.wait(wait):
                raise FlightTimeout(f"the collection has been running for {time.monotonic() - flight.started:.0f} s, "
                                    f"past its {self._deadline_s:g} s deadline")  # fmt: skip
        if flight.error is not None:
            raise flight.error
        assert flight.result is not None
        return flight.result

    def _fly(self, flight: _Flight[T]) -> None:
        try:
            flight.result = self._fn()
        except BaseException as exc:
            flight.error = exc
        finally:
            with self._lock:
                self._flight = None
            flight.done.set()

    def running_for(self) -> float:
        """How long the call in progress has been running; 0 when none is."""
        flight = self._flight
        return 0.0 if flight is None else time.monotonic() - flight.started


class _Flight(Generic[T]):
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


# Past this a collection counts as stuck (a call that does not return): scrapes stop waiting for it and /healthz
# fails. Healthy ones take the engine timeout at most plus a few seconds; the first one over 10,000 manifests on a
# busy machine, up to 30 s (tests/reliability/test_many_files.py).
DEFAULT_COLLECTION_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class CollectionSettings:
    manifest_dir: str
    targets: tuple[EngineTarget, ...] = ()
    fetch_timeout_s: float = DEFAULT_TIMEOUT_S
    max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES
    manifest_limits: ManifestLimits = DEFAULT_LIMITS
    max_series: int = DEFAULT_MAX_SERIES
    max_label_bytes: int = DEFAULT_MAX_LABEL_BYTES
    proc: str = "/proc"
    deadline_s: float = DEFAULT_COLLECTION_TIMEOUT_S
    running_window_s: float = DEFAULT_WINDOW_S


class Collection:
    """Everything one scrape needs, gathered once per scrape (single-flight) into a Snapshot."""

    def __init__(self, settings: CollectionSettings, gpu_reader: GpuReader | None, our_namespace: str | None = None):
        self.settings = settings
        self.gpu_reader = gpu_reader
        self.our_namespace = current_pid_namespace() if our_namespace is None else our_namespace
        self.store = ManifestStore(settings.manifest_dir, settings.manifest_limits)
        self.pages = EnginePages(settings.targets, settings.fetch_timeout_s, settings.max_page_bytes)
        self.records = StepRecords(settings.running_window_s)
        self.observations = ObservationAccount()
        self.processes = ProcessWatch(settings.proc)
        self.declared = DeclaredCache()
        nvml = gpu_reader is not None and gpu_reader.source == SOURCE_NVML
        self.nvml_errors_total: Counter[str] = Counter(dict.fromkeys(NVML_ERROR_REASONS if nvml else (), 0))
        self._last_nvml_error: str | None = None
        self._last_dropped: tuple[tuple[str, ...], int] = ((), 0)
        self.snapshot = SingleFlight(self._collect, settings.deadline_s)

    def _collect(self) -> Snapshot:
        started = time.perf_counter()
        # The engines answer while the manifests are read: the pages are read in this thread, so nothing competes for
        # the GIL (fetch threads did: 4.6 against 4.0 ms of CPU a scrape,
        # docs/decisions/0016-engine-pages-on-an-event-loop.md).
        reads = self.pages.begin()
        entries = assess(self.store.load(), self.our_namespace, self.settings.proc, self.processes)
        pages = self.pages.finish(reads, running_limits(entries))
        # After the pages, which may keep the collection waiting: the count is the one nearest the answer.
        workers = engines_running(entries, self.records.read(entries))
        gpu = read_gpus(self.gpu_reader, entries)
        self._account_gpu(gpu)
        now = time.time()
        self.observations.account(entries, now)
        snapshot = build_snapshot(
            entries,
            pages,
            gpu,
            cap=SeriesCap(self.settings.max_series, self.settings.max_label_bytes),
            manifest_folder=self.settings.manifest_dir,
            manifest_folder_error=self.store.folder_error,
            manifest_folder_state=self.store.folder_state,
            manifest_errors_total=dict(self.store.errors_total),
            page_errors_total=dict(self.pages.errors_total),
            nvml_errors_total=dict(self.nvml_errors_total),
            observation_errors_total=dict(self.observations.errors_total),
            duration_s=time.perf_counter() - started,
            taken_at=now,
            cache=self.declared,
            workers=workers,
        )
        self._account_series(snapshot)
        return_free_memory()  # what a large input (now gone) left in the heaps: see allocator.py
        return snapshot

    def _account_series(self, snapshot: Snapshot) -> None:
        """Log when what the series cap leaves out changes, not on every scrape."""
        dropped = (snapshot.series_dropped, snapshot.engines_dropped)
        if dropped == self._last_dropped:
            return
        paths, engines = dropped
        if paths or engines:
            shown = ", ".join(map(printable, paths[:3])) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
            log.warning(
                "series cap reached (--max-series %d, --max-label-bytes %d): %d live manifest(s) left out "
                "(%s); %d engine(s) that only a page shows left out",
                self.settings.max_series, self.settings.max_label_bytes, len(paths), shown or "none", engines,
            )  # fmt: skip
        else:
            log.info("series cap no longer reached: every live manifest and engine is exported")
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

    def overdue_s(self) -> float:
        """How far the collection in progress is past its deadline (stuck in a read that never returns); 0 if not."""
        return max(0.0, self.snapshot.running_for() - self.settings.deadline_s)

    def close(self) -> None:
        self.pages.close()
        self.processes.close()
        self.records.close()


class KVCollector(Collector):
    """The prometheus_client collector: everything is computed at scrape time from one shared collection."""

    def __init__(self, collection: Collection) -> None:
        self.collection = collection
        self.declarations = DeclarationFamilies()

    def collect(self) -> Iterable[Metric]:
        return families(self.collection.snapshot(), self.declarations)
