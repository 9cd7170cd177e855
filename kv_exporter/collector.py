"""The sidecar's collector: manifests + engine pages + NVML -> one `Snapshot` -> Prometheus metric families.

Data flows one way. Each scrape:
  1. `ManifestStore.load` lists the manifest folder; a file is re-parsed only when its stat changes.
  2. `liveness.classify` marks each valid manifest live or stale.
  3. `EnginePages.read_all` fetches every configured engine page in parallel (one fetch per engine).
  4. The GPU reader (NVML or simulated) gives per-GPU memory, and per-process memory where pids compare.
  5. `build_snapshot` (pure) combines them; `families` turns a snapshot into metric families.
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
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample, Timestamp

from kv_exporter import __version__
from kv_exporter.engine_page import (
    DEFAULT_MAX_PAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    EngineKey,
    EnginePage,
    EnginePageError,
    EngineTarget,
    read_engine,
)
from kv_exporter.liveness import State, Verdict, classify
from kv_exporter.manifest import (
    DEFAULT_LIMITS,
    Declaration,
    Manifest,
    ManifestError,
    ManifestLimits,
    current_pid_namespace,
    is_manifest_name,
    read_manifest,
)
from kv_exporter.nvml import SOURCE_SIMULATED, GpuMemory, GpuReader, GpuReadError

log = logging.getLogger(__name__)

T = TypeVar("T")


# -- inputs --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ManifestEntry:
    """One manifest file: a valid manifest with its liveness verdict, or why it is invalid."""

    path: str
    manifest: Manifest | None
    verdict: Verdict
    error: ManifestError | None = None

    @property
    def live(self) -> bool:
        return self.verdict.state is State.LIVE


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


@dataclass(frozen=True)
class PageResult:
    target: str
    page: EnginePage | None
    error: EnginePageError | None
    seconds: float


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


@dataclass(frozen=True)
class GpuResult:
    """One pass over the GPU reader. `devices` is empty when it could not be read; `error` says why."""

    enabled: bool
    source: str | None
    devices: tuple[GpuMemory, ...] = ()
    processes: dict[int, dict[int, int]] = field(default_factory=dict)  # NVML index -> pid -> bytes
    error: GpuReadError | None = None
    device_errors: tuple[GpuReadError, ...] = ()

    @property
    def up(self) -> bool:
        return self.enabled and self.error is None


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


def on_device(manifest: Manifest, device: GpuMemory) -> bool:
    """A manifest's GPU by UUID when it recorded one, else by NVML index."""
    return _placed_on(manifest.device.uuid or "", manifest.device.index, device)


def _placed_on(uuid: str, index: int | None, device: GpuMemory) -> bool:
    if uuid:
        return uuid == device.uuid
    return index is not None and index == device.index


def placement(manifest: Manifest, gpu: GpuResult) -> tuple[int | None, str]:
    """(index, UUID) of the GPU a manifest's declarations sit on.

    As recorded, except that a simulated device stands in for the GPU of an engine that recorded none (a CPU
    engine in the demo or the end-to-end tests): that is what simulating a device is for. Real NVML readings never
    adopt anything, and a simulation adopts only when it is the one device, so nothing is guessed.
    """
    recorded = manifest.device
    if recorded.uuid is None and recorded.index is None and gpu.source == SOURCE_SIMULATED and len(gpu.devices) == 1:
        return gpu.devices[0].index, gpu.devices[0].uuid
    return recorded.index, recorded.uuid or ""


def _uuid_index(manifest: Manifest, gpu: GpuResult) -> tuple[str, int | None]:
    index, uuid = placement(manifest, gpu)
    return uuid, index


# -- the snapshot --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeclarationView:
    """One live declaration with its figures at the engine's max_num_seqs and at the live running count."""

    model_name: str
    stage: int
    engine: int
    gpu: str
    uuid: str
    declaration: Declaration
    max_num_seqs: int
    running: int | None
    ceiling_rows: int
    estimate_rows: int

    @property
    def ceiling_bytes(self) -> int:
        return self.declaration.bytes_per_row * self.ceiling_rows

    @property
    def estimate_bytes(self) -> int:
        return self.declaration.bytes_per_row * self.estimate_rows

    @property
    def headroom_needed(self) -> int:
        """Bytes this cache may still grow by: what the projection adds to NVML's used figure."""
        return self.ceiling_bytes - self.estimate_bytes


@dataclass(frozen=True)
class EngineView:
    key: EngineKey
    up: bool
    running: int | None
    max_num_seqs: int | None
    manifests: int
    target: str | None  # the page it was read from


@dataclass(frozen=True)
class GpuView:
    memory: GpuMemory
    source: str
    projected_peak: int
    safe_max_num_seqs: int | None  # None: no max_num_seqs-driven declaration on this GPU
    processes: dict[int, int]  # matched manifest pid -> NVML used bytes
    declarations: int

    @property
    def headroom(self) -> int:
        return self.memory.total - self.projected_peak


@dataclass(frozen=True)
class Snapshot:
    manifests: tuple[ManifestEntry, ...]
    declarations: tuple[DeclarationView, ...]
    engines: tuple[EngineView, ...]
    pages: tuple[PageResult, ...]
    gpus: tuple[GpuView, ...]
    gpu: GpuResult
    manifest_errors_total: dict[str, int]
    page_errors_total: dict[tuple[str, str], int]
    nvml_errors_total: dict[str, int]
    manifest_folder: str
    manifest_folder_error: str | None
    duration_s: float
    taken_at: float
    series_dropped: tuple[str, ...] = ()  # live manifests left out by the series cap (paths)

    def manifest_counts(self) -> dict[State, int]:
        counts = dict.fromkeys(State, 0)
        for entry in self.manifests:
            counts[entry.verdict.state] += 1
        return counts


RunningCounts = dict[EngineKey, tuple[int, str]]  # running count and the page it came from
Views = Sequence[DeclarationView]


def running_counts(pages: Sequence[PageResult]) -> RunningCounts:
    """Running count per engine and the page it came from; the first configured page wins a duplicate."""
    found: dict[EngineKey, tuple[int, str]] = {}
    for result in pages:
        if result.page is None:
            continue
        for key in result.page.running:
            running = result.page.running_for(key)
            if running is not None and key not in found:
                found[key] = (running, result.target)
    return found


def engine_key(manifest: Manifest) -> EngineKey:
    e = manifest.engine
    return EngineKey(e.model_name, e.stage, e.engine_index)


def declaration_views(
    entries: Sequence[ManifestEntry], running: dict[EngineKey, tuple[int, str]], gpu: GpuResult
) -> list[DeclarationView]:
    views = []
    for entry in entries:
        m = entry.manifest
        if m is None or not entry.live:
            continue
        known = running.get(engine_key(m))
        index, uuid = placement(m, gpu)
        for d in m.declarations:
            # Engine unreadable: MAX_NUM_SEQS rows fall back to 0, so the projected peak stays an upper bound.
            live_rows = d.rows_at(min(known[0], m.max_num_seqs)) if known else d.rows_at(0)
            views.append(
                DeclarationView(
                    model_name=m.engine.model_name,
                    stage=m.engine.stage,
                    engine=m.engine.engine_index,
                    gpu="" if index is None else str(index),
                    uuid=uuid,
                    declaration=d,
                    max_num_seqs=m.max_num_seqs,
                    running=known[0] if known else None,
                    ceiling_rows=d.row_count(m.max_num_seqs),
                    estimate_rows=live_rows,
                )
            )
    return sorted(
        views, key=lambda v: (v.model_name, v.stage, v.engine, v.gpu, v.declaration.owner, v.declaration.name)
    )


def engine_views(entries: Sequence[ManifestEntry], running: RunningCounts) -> list[EngineView]:
    manifests: Counter[EngineKey] = Counter()
    max_seqs: dict[EngineKey, int] = {}
    for entry in entries:
        if entry.manifest is not None and entry.live:
            key = engine_key(entry.manifest)
            manifests[key] += 1
            max_seqs[key] = max(max_seqs.get(key, 0), entry.manifest.max_num_seqs)
    views = []
    for key in sorted(set(manifests) | set(running)):
        known = running.get(key)
        views.append(
            EngineView(
                key=key,
                up=known is not None,
                running=known[0] if known else None,
                max_num_seqs=max_seqs.get(key),
                manifests=manifests[key],
                target=known[1] if known else None,
            )
        )
    return views


def safe_max_num_seqs(device: GpuMemory, views: Sequence[DeclarationView]) -> int | None:
    """Largest M with used + sum(bytes_per_row * max(0, M - estimated rows)) <= total, over this GPU's
    max_num_seqs-driven declarations (every engine on the GPU at the same M); None when there are none."""
    # (bytes_per_row, estimated rows) pairs: the search below evaluates peak() ~30 times per GPU.
    scaling = [(v.declaration.bytes_per_row, v.estimate_rows) for v in views if not v.declaration.is_fixed]
    if not scaling:
        return None

    def peak(m: int) -> int:
        return device.used + sum(per_row * (m - rows) for per_row, rows in scaling if m > rows)

    if peak(0) > device.total:
        return 0
    # peak(hi) > total: the cheapest row alone overflows the free bytes by then.
    cheapest_per_row, cheapest_rows = min(scaling)
    low = 0
    high = cheapest_rows + (device.total - device.used) // cheapest_per_row + 1
    while high - low > 1:
        middle = (low + high) // 2
        if peak(middle) <= device.total:
            low = middle
        else:
            high = middle
    return low


def gpu_views(gpu: GpuResult, entries: Sequence[ManifestEntry], views: Views) -> list[GpuView]:
    result = []
    # Grouped in one pass each, not one pass per device (docs/benchmarks.md, target 1).
    views_at = _by_place(((v.uuid, None if v.gpu == "" else int(v.gpu)), v) for v in views)
    pids_at = _by_place(
        (_uuid_index(e.manifest, gpu), e.manifest.process.pid) for e in entries if e.manifest is not None and e.live
    )
    for device in gpu.devices:
        mine = _placed(views_at, device)
        pids = set(_placed(pids_at, device))
        listed = gpu.processes.get(device.index, {})
        result.append(
            GpuView(
                memory=device,
                source=gpu.source or "",
                projected_peak=device.used + sum(v.headroom_needed for v in mine),
                safe_max_num_seqs=safe_max_num_seqs(device, mine),
                processes={pid: listed[pid] for pid in sorted(pids) if pid in listed},
                declarations=len(mine),
            )
        )
    return result


_Place = tuple[str, int | None]  # (UUID or "", index): what `_placed_on` matches a device by
P = TypeVar("P")


def _by_place(items: Iterable[tuple[_Place, P]]) -> dict[_Place, list[P]]:
    groups: dict[_Place, list[P]] = {}
    for place, item in items:
        # A UUID decides alone (see _placed_on): keyed by it, the index is irrelevant.
        groups.setdefault((place[0], None) if place[0] else place, []).append(item)
    return groups


def _placed(groups: dict[_Place, list[P]], device: GpuMemory) -> list[P]:
    """The items `_placed_on` would put on `device`."""
    return groups.get((device.uuid, None), []) + groups.get(("", device.index), [])


# What one live manifest can add to the page: the per-declaration families for each of its declarations, and the
# per-engine families for its engine. Per-GPU and per-page series are bounded by the hardware and the configuration,
# not by what a declarer writes, so only these count against the series cap.
SERIES_PER_DECLARATION = 5
SERIES_PER_ENGINE = 4
# 10,000 declarations' worth: far above a real node (a few engines per GPU, a handful of caches each), and still a
# page Prometheus takes in one scrape (~13 MB of text, ~1-2 s on two cores).
DEFAULT_MAX_SERIES = SERIES_PER_DECLARATION * 10_000


def manifest_series(manifest: Manifest) -> int:
    """The most series one live manifest can add to the page."""
    return SERIES_PER_DECLARATION * len(manifest.declarations) + SERIES_PER_ENGINE


def _age(entry: ManifestEntry) -> tuple[float, str]:
    return (entry.manifest.written_at if entry.manifest else 0.0, entry.path)


def limit_series(
    entries: Sequence[ManifestEntry], max_series: int | None
) -> tuple[list[ManifestEntry], list[ManifestEntry]]:
    """(kept, dropped) live manifests under the series cap.

    Oldest first (by `written_at`, then path) until the next manifest would take the page past `max_series`; that
    one and every newer one are dropped whole (part of a manifest would understate its engine without saying so).
    Oldest first keeps the series Prometheus already has: a runaway declarer or a burst of new engines loses its own
    series, not everybody else's. The rule depends only on the files, so the same manifests stay out scrape after
    scrape.
    """
    live = sorted((e for e in entries if e.live and e.manifest is not None), key=_age)
    total = 0
    for i, entry in enumerate(live):
        total += manifest_series(entry.manifest) if entry.manifest else 0
        if max_series is not None and total > max_series:
            return live[:i], live[i:]
    return live, []


def _mark_dropped(entries: Sequence[ManifestEntry], dropped: Sequence[ManifestEntry]) -> list[ManifestEntry]:
    """The entries, the dropped ones saying so (for the landing page; their state stays live)."""
    paths = {e.path for e in dropped}
    note = "; left out of the metrics: over --max-series"
    return [
        replace(e, verdict=Verdict(e.verdict.state, e.verdict.why + note)) if e.path in paths else e for e in entries
    ]


def build_snapshot(
    entries: Sequence[ManifestEntry],
    pages: Sequence[PageResult],
    gpu: GpuResult,
    *,
    max_series: int | None = None,
    manifest_folder: str = "",
    manifest_folder_error: str | None = None,
    manifest_errors_total: dict[str, int] | None = None,
    page_errors_total: dict[tuple[str, str], int] | None = None,
    nvml_errors_total: dict[str, int] | None = None,
    duration_s: float = 0.0,
    taken_at: float = 0.0,
) -> Snapshot:
    """Pure: the same inputs give the same snapshot."""
    kept, dropped = limit_series(entries, max_series)
    running = running_counts(pages)
    views = declaration_views(kept, running, gpu)
    # The cap limits series, not truth: left-out manifests still count in their GPU's projected peak.
    unexported = declaration_views(dropped, running, gpu) if dropped else []
    return Snapshot(
        manifests=tuple(_mark_dropped(entries, dropped) if dropped else entries),
        declarations=tuple(views),
        engines=tuple(engine_views(kept, running)),
        pages=tuple(pages),
        gpus=tuple(gpu_views(gpu, entries, [*views, *unexported])),
        gpu=gpu,
        manifest_errors_total=dict(manifest_errors_total or {}),
        page_errors_total=dict(page_errors_total or {}),
        nvml_errors_total=dict(nvml_errors_total or {}),
        manifest_folder=manifest_folder,
        manifest_folder_error=manifest_folder_error,
        duration_s=duration_s,
        taken_at=taken_at,
        series_dropped=tuple(sorted(e.path for e in dropped)),
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


# -- metric families -----------------------------------------------------------------------------------------

DECLARATION_LABELS = ("model_name", "stage", "engine", "owner", "cache", "scope", "driver", "gpu", "UUID")
INFO_EXTRA_LABELS = ("dtype", "capacity_source", "rows_fixed", "rows_reason", "allocation_note")
ENGINE_LABELS = ("model_name", "stage", "engine")
GPU_LABELS = ("gpu", "UUID", "source")

SAFE_MAX_NUM_SEQS_HELP = (
    "Largest max_num_seqs M (the same for every engine on this GPU) with NVML used + sum over its "
    "live max_num_seqs-driven declarations of bytes_per_row * max(0, M - estimated rows) <= total. "
    "Assumes NVML used already holds the estimated and fixed rows and nothing else on the GPU grows."
)


class GaugeRows(GaugeMetricFamily):
    """A gauge family that keeps its series as (label values, value) rows.

    prometheus_client's `Sample` objects (a label dict each) are built only when something asks for `samples`;
    the exporter's own exposition (`server.Exposition`) reads `rows`. On a page of a few hundred declaration
    series, making and re-reading those dicts was a third of the scrape (docs/benchmarks.md, target 1).
    """

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        self.label_names = tuple(labels)
        self.rows: list[tuple[tuple[str, ...], float]] = []
        super().__init__(name, documentation, labels=list(labels))

    def add_metric(self, labels: Sequence[str], value: float, timestamp: float | Timestamp | None = None) -> None:
        if timestamp is not None or len(labels) != len(self.label_names):
            raise ValueError(f"{self.name}: want {len(self.label_names)} label values and no timestamp")
        self.rows.append((tuple(labels), value))

    @property
    def samples(self) -> list[Sample]:
        names = self.label_names
        return [Sample(self.name, dict(zip(names, labels, strict=True)), value) for labels, value in self.rows]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:  # Metric.__init__ sets [], which is all there is to set
            raise AttributeError(f"{self.name}: add series with add_metric")


def _gauge(name: str, doc: str, labels: Sequence[str]) -> GaugeRows:
    return GaugeRows(name, doc, labels)


def _declaration_labels(view: DeclarationView) -> tuple[str, ...]:
    d = view.declaration
    return (
        view.model_name,
        str(view.stage),
        str(view.engine),
        d.owner,
        d.name,
        d.scope,
        d.rows,
        view.gpu,
        view.uuid,
    )


def declaration_families(views: Sequence[DeclarationView]) -> list[Metric]:
    per_row = _gauge("model_local_kv_bytes_per_row", "Bytes in one row.", DECLARATION_LABELS)
    ceiling = _gauge(
        "model_local_kv_ceiling_bytes",
        "Bytes at the engine's max_num_seqs rows (rows_fixed for driver=fixed).",
        DECLARATION_LABELS,
    )
    estimate = _gauge(
        "model_local_kv_estimated_bytes",
        "Bytes at the live running count capped at max_num_seqs (rows_fixed for driver=fixed; 0 rows for "
        "driver=max_num_seqs while the engine cannot be read).",
        DECLARATION_LABELS,
    )
    positions = _gauge(
        "model_local_kv_capacity_positions", "Positions one row can physically hold.", DECLARATION_LABELS
    )
    info = _gauge(
        "model_local_kv_declaration_info",
        "Declaration metadata (value 1).",
        DECLARATION_LABELS + INFO_EXTRA_LABELS,
    )
    for labels, group in _merge_duplicates(views).items():
        first = group[0].declaration
        per_row.add_metric(labels, first.bytes_per_row)
        ceiling.add_metric(labels, sum(v.ceiling_bytes for v in group))
        estimate.add_metric(labels, sum(v.estimate_bytes for v in group))
        positions.add_metric(labels, first.physical_capacity_positions)
        extra = (first.dtype, first.capacity_source, str(first.rows_fixed), first.rows_reason)
        info.add_metric((*labels, *extra, first.allocation_note or ""), 1)
    return [per_row, ceiling, estimate, positions, info]


def _merge_duplicates(views: Iterable[DeclarationView]) -> dict[tuple[str, ...], list[DeclarationView]]:
    """Ranks of one engine sharing a GPU would repeat a label set: their bytes add up under one series."""
    groups: dict[tuple[str, ...], list[DeclarationView]] = {}
    for view in views:
        groups.setdefault(_declaration_labels(view), []).append(view)
    return groups


def engine_families(engines: Sequence[EngineView], pages: Sequence[PageResult]) -> list[Metric]:
    running = _gauge(
        "model_local_kv_running_sequences",
        "Running sequences read from the engine's metrics page (per stage capped by the pipeline gauge).",
        ENGINE_LABELS,
    )
    max_seqs = _gauge("model_local_kv_max_num_seqs", "max_num_seqs from its manifests.", ENGINE_LABELS)
    up = _gauge("model_local_kv_engine_up", "1 if its running count was read this scrape.", ENGINE_LABELS)
    manifests = _gauge(
        "model_local_kv_engine_manifests",
        "Live valid manifests matched to this engine (0: the engine runs but declares nothing here).",
        ENGINE_LABELS,
    )
    for view in engines:
        labels = (view.key.model_name, str(view.key.stage), str(view.key.engine))
        if view.running is not None:
            running.add_metric(labels, view.running)
        if view.max_num_seqs is not None:
            max_seqs.add_metric(labels, view.max_num_seqs)
        up.add_metric(labels, int(view.up))
        manifests.add_metric(labels, view.manifests)
    page_up = _gauge("model_local_kv_engine_page_up", "1 if the page was fetched and read.", ("target",))
    for page in pages:
        page_up.add_metric((page.target,), int(page.page is not None))
    return [running, max_seqs, up, manifests, page_up]


def gpu_families(gpus: Sequence[GpuView]) -> list[Metric]:
    total = _gauge("model_local_kv_gpu_memory_total_bytes", "GPU memory total (NVML).", GPU_LABELS)
    used = _gauge("model_local_kv_gpu_memory_used_bytes", "GPU memory used (NVML).", GPU_LABELS)
    free = _gauge("model_local_kv_gpu_memory_free_bytes", "GPU memory free (NVML).", GPU_LABELS)
    process = _gauge(
        "model_local_kv_gpu_process_memory_bytes",
        "GPU memory NVML reports for a manifest's process (only where the pids are comparable).",
        (*GPU_LABELS, "pid"),
    )
    peak = _gauge(
        "model_local_kv_gpu_projected_peak_bytes",
        "NVML used + sum over this GPU's live declarations of (ceiling - estimate).",
        GPU_LABELS,
    )
    headroom = _gauge(
        "model_local_kv_gpu_headroom_bytes",
        "total - projected peak (negative: it would not fit).",
        GPU_LABELS,
    )
    safe = _gauge("model_local_kv_gpu_safe_max_num_seqs", SAFE_MAX_NUM_SEQS_HELP, GPU_LABELS)
    for view in gpus:
        labels = (str(view.memory.index), view.memory.uuid, view.source)
        total.add_metric(labels, view.memory.total)
        used.add_metric(labels, view.memory.used)
        free.add_metric(labels, view.memory.free)
        for pid, value in view.processes.items():
            process.add_metric((*labels, str(pid)), value)
        peak.add_metric(labels, view.projected_peak)
        headroom.add_metric(labels, view.headroom)
        if view.safe_max_num_seqs is not None:
            safe.add_metric(labels, view.safe_max_num_seqs)
    return [total, used, free, process, peak, headroom, safe]


def exporter_families(snapshot: Snapshot) -> list[Metric]:
    nvml_up = GaugeMetricFamily(
        "model_local_kv_nvml_up",
        "1 if the GPU reader (NVML or simulated) answered this scrape.",
        value=int(snapshot.gpu.up),
    )
    manifests = _gauge("model_local_kv_manifests", "Manifest files by state.", ("state",))
    for state, count in snapshot.manifest_counts().items():
        manifests.add_metric((state.value,), count)
    manifest_errors = CounterMetricFamily(
        "model_local_kv_manifest_errors", "Invalid manifest file versions seen, by reason.", labels=["reason"]
    )
    for reason, count in sorted(snapshot.manifest_errors_total.items()):
        manifest_errors.add_metric((reason,), count)
    page_errors = CounterMetricFamily(
        "model_local_kv_engine_page_errors",
        "Failed engine page reads, by target and reason.",
        labels=["target", "reason"],
    )
    for (target, reason), count in sorted(snapshot.page_errors_total.items()):
        page_errors.add_metric((target, reason), count)
    nvml_errors = CounterMetricFamily(
        "model_local_kv_nvml_errors", "Failed GPU reader calls, by reason.", labels=["reason"]
    )
    for reason, count in sorted(snapshot.nvml_errors_total.items()):
        nvml_errors.add_metric((reason,), count)
    dropped = GaugeMetricFamily(
        "model_local_kv_series_limit_dropped_manifests",
        "Live manifests left out of this page because their series would exceed --max-series (newest first).",
        value=len(snapshot.series_dropped),
    )
    duration = GaugeMetricFamily(
        "model_local_kv_scrape_duration_seconds", "Seconds the collection took.", value=snapshot.duration_s
    )
    build = _gauge("model_local_kv_exporter_build_info", "kv-exporter version (value 1).", ("version",))
    build.add_metric((__version__,), 1)
    return [nvml_up, manifests, manifest_errors, page_errors, nvml_errors, dropped, duration, build]


def families(snapshot: Snapshot) -> list[Metric]:
    return [
        *declaration_families(snapshot.declarations),
        *engine_families(snapshot.engines, snapshot.pages),
        *gpu_families(snapshot.gpus),
        *exporter_families(snapshot),
    ]


class KVCollector(Collector):
    """The prometheus_client collector: everything is computed at scrape time from one shared collection."""

    def __init__(self, collection: Collection) -> None:
        self.collection = collection

    def collect(self) -> Iterable[Metric]:
        return families(self.collection.snapshot())
