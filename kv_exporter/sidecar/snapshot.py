"""The snapshot: one scrape's inputs combined into the figures every output reads (pure, no I/O).

Inputs are records (`ManifestEntry`, `PageResult`, `GpuResult`, the workers' `Running`) that `inputs` and
`running` gather; the snapshot holds one view per live declaration, engine and GPU: ceiling, estimate and estimated
peak, running count and its most, projected peak, headroom and safe max_num_seqs. `families` turns it into metric
families, `landing` into the landing page. The same inputs always give the same snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from kv_exporter.gpu import GpuMemory
from kv_exporter.manifest import Declaration, Manifest, PodInfo
from kv_exporter.sidecar.budget import NO_CAP, SeriesCap, limit_series
from kv_exporter.sidecar.declared import Declared, DeclaredCache, PlacedDeclaration
from kv_exporter.sidecar.engine_page import EngineKey
from kv_exporter.sidecar.limits import (
    BINDING_DEVICE,
    BINDING_WORKER,
    EngineBudget,
    Limits,
    WorkerLimit,
    engine_budgets,
    worker_limits,
)
from kv_exporter.sidecar.liveness import State, Verdict
from kv_exporter.sidecar.observed import Observed, ObservedState, OwnerView, observe, worker_state
from kv_exporter.sidecar.records import (
    DeviceKey,
    FolderState,
    GpuResult,
    ManifestEntry,
    PageResult,
    Placement,
    device_keys,
    engine_key,
    first_rank,
    placement,
)
from kv_exporter.sidecar.running import ABSENT, Running, RunningState


@dataclass(frozen=True, slots=True)
class DeclarationView:
    """One live declaration with its figures at the engine's max_num_seqs, at the live running count, and at the
    most its workers ran over the window (None: no step record gives it)."""

    placed: PlacedDeclaration
    running: int | None
    estimate_rows: int
    estimate_bytes: int
    peak_bytes: int | None = None

    @property
    def model_name(self) -> str:
        return self.placed.engine.model_name

    @property
    def declaration(self) -> Declaration:
        return self.placed.declaration

    @property
    def ceiling_bytes(self) -> int:
        return self.placed.ceiling_bytes

    @property
    def headroom_needed(self) -> int:
        """Bytes this cache may still grow by: what the projection adds to NVML's used figure."""
        return self.ceiling_bytes - self.estimate_bytes


@dataclass(frozen=True)
class EngineView:
    key: EngineKey
    pod: PodInfo  # of its first-rank manifest; unknown for an engine only a page shows
    up: bool
    running: int | None
    max_num_seqs: int | None
    manifests: int
    target: str | None  # where the running count was read: WORKERS (their step records) or the page's target
    state: RunningState = RunningState.ABSENT  # its workers' step records
    most: int | None = None  # the most its workers ran over the window
    page_difference: int | None = None  # the page's running count less the workers' (both known)


@dataclass(frozen=True)
class GpuView:
    """A GPU this exporter's engines use: its memory, and the projection against the limit met first."""

    memory: GpuMemory
    source: str
    projected_peak: int  # in the device's terms: what NVML would show occupied at the peak
    safe_max_num_seqs: int | None  # None: nothing on this GPU scales with max_num_seqs
    processes: dict[int, int]  # matched manifest pid -> NVML used bytes
    declarations: int
    unexplained_growth: int  # the part of the projected peak that observation adds to the declarations' growth
    resident: int  # declared memory already held beyond the estimates: in used, so not added again
    headroom: int  # to the binding limit: the device's total, or a worker's allocator cap, whichever is met first
    binding: str  # limits.BINDING_DEVICE or BINDING_WORKER
    declared_ceiling: int  # the live declarations' ceilings on this GPU, summed
    pod: PodInfo  # of the engines on it, where they share one pod; unknown where several pods use it
    other_processes: int | None  # compute processes NVML lists that no manifest accounts for (None: unread)

    @property
    def limit(self) -> int:
        """The occupancy (in the device's terms) at which the binding limit is met."""
        return self.projected_peak + self.headroom

    @property
    def projected(self) -> bool:
        """False while processes no manifest accounts for share it: their growth is unknown, so no projection."""
        return not self.other_processes


@dataclass(frozen=True)
class Snapshot:
    manifests: tuple[ManifestEntry, ...]
    declared: Declared  # what `declarations` are the views of: the same object while no manifest changes it
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
    observed: Observed = field(default_factory=Observed)
    limits: Limits = field(default_factory=Limits)
    budgets: tuple[EngineBudget, ...] = ()
    observation_errors_total: dict[str, int] = field(default_factory=dict)
    series_dropped: tuple[str, ...] = ()  # live manifests left out by the series cap (paths)
    engines_dropped: int = 0  # engines only a page shows, left out by the series cap
    manifest_folder_state: FolderState = FolderState.OK

    def manifest_counts(self) -> dict[State, int]:
        counts = dict.fromkeys(State, 0)
        for entry in self.manifests:
            counts[entry.verdict.state] += 1
        return counts


RunningCounts = dict[EngineKey, tuple[int, str]]  # running count and where it was read (WORKERS, or a page)
WORKERS = "workers"  # a running count from the engine's workers' step records


def page_counts(pages: Sequence[PageResult]) -> RunningCounts:
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


def running_counts(pages: RunningCounts, workers: dict[EngineKey, Running]) -> RunningCounts:
    """The running count every figure uses: the workers' where they keep a step record, else the page's. An engine
    whose records cannot say has none (never the page's in their place: it would be mixed in silently)."""
    found = {key: count for key, count in pages.items() if workers.get(key, ABSENT).state is RunningState.ABSENT}
    for key, running in workers.items():
        if running.latest is not None:
            found[key] = (running.latest, WORKERS)
    return found


def declaration_views(
    declared: Declared, running: RunningCounts, workers: dict[EngineKey, Running] | None = None
) -> list[DeclarationView]:
    """One view per declaration, in `declared.ordered`'s order."""
    ordered = declared.ordered
    workers = workers or {}
    views: list[DeclarationView] = [None] * len(ordered)  # type: ignore[list-item]  # each index set below
    for engine, at in declared.by_engine:
        known = running.get(engine)
        count = known[0] if known else None
        most = workers.get(engine, ABSENT).most
        rows_of: dict[tuple[object, ...], tuple[int, int | None]] = {}  # an engine's declarations share few rules
        for index in at:
            placed = ordered[index]
            d = placed.declaration
            rule = (d.rows, d.rows_fixed, placed.max_num_seqs)
            rows_and_peak = rows_of.get(rule)
            if rows_and_peak is None:
                # Engine unreadable: MAX_NUM_SEQS rows fall back to 0, so the projected peak stays an upper bound.
                rows_and_peak = rows_of[rule] = (placed.rows_at(count), None if most is None else placed.rows_at(most))
            rows, peak_rows = rows_and_peak
            per_row = d.bytes_per_row
            views[index] = DeclarationView(
                placed, count, rows, per_row * rows, None if peak_rows is None else per_row * peak_rows
            )
    return views


def _placed(
    entries: Sequence[ManifestEntry], gpu: GpuResult, cache: DeclaredCache
) -> list[tuple[PlacedDeclaration, ...]]:
    return [cache.place(e.manifest, placement(e.manifest, gpu)) for e in entries if e.manifest is not None and e.live]


def engine_views(
    entries: Sequence[ManifestEntry],
    running: RunningCounts,
    page_engines: Iterable[EngineKey] = (),
    workers: dict[EngineKey, Running] | None = None,
    pages: RunningCounts | None = None,
) -> list[EngineView]:
    """The engines of the live manifests in `entries`, and `page_engines`: ones only a page shows."""
    workers, pages = workers or {}, pages or {}
    by_engine: dict[EngineKey, list[Manifest]] = {}
    for entry in entries:
        if entry.manifest is not None and entry.live:
            by_engine.setdefault(engine_key(entry.manifest), []).append(entry.manifest)
    views = []
    for key in sorted(set(by_engine) | set(page_engines)):
        known = running.get(key)
        mine = by_engine.get(key, [])
        recorded = workers.get(key, ABSENT)
        page = pages.get(key)
        views.append(
            EngineView(
                key=key,
                pod=first_rank(mine).pod if mine else PodInfo(),
                up=known is not None,
                running=known[0] if known else None,
                max_num_seqs=max((m.max_num_seqs for m in mine), default=None),
                manifests=len(mine),
                target=known[1] if known else None,
                state=recorded.state,
                most=recorded.most,
                page_difference=None if page is None or recorded.latest is None else page[0] - recorded.latest,
            )
        )
    return views


NO_LIMITS = Limits()


def safe_max_num_seqs(free: int, views: Sequence[DeclarationView], owners: Sequence[OwnerView] = ()) -> int | None:
    """Largest M with sum(bytes_per_row * max(0, M - rows held)) <= `free` (a device's total - occupied, or a
    worker's cap - reserved), over the max_num_seqs-driven declarations in `views` and the owners whose unexplained
    bytes grow with running sequences (every engine at the same M); None when there are none. Rows held: the
    estimated rows, and the rows an owner already holds beyond them (its resident bytes, whole rows, given to its
    declarations in page order)."""
    resident = {(o.key, o.placement, o.pod, o.owner): o.resident_bytes for o in owners if o.resident_bytes}
    scaling = [(o.running or 0, o.unexplained_per_sequence) for o in owners if o.unexplained_per_sequence]
    for v in views:
        placed = v.placed
        if not placed.scales:
            continue
        per_row = placed.declaration.bytes_per_row
        held = 0
        if resident:
            owner = (placed.engine, placed.placement, placed.pod, placed.declaration.owner)
            held = min(resident.get(owner, 0) // per_row if per_row else 0, placed.ceiling_rows - v.estimate_rows)
            if held > 0:
                resident[owner] -= held * per_row
        scaling.append((v.estimate_rows + max(0, held), per_row))
    if not any(per_row for _, per_row in scaling):  # nothing grows
        return None
    if free < 0:
        return 0
    # The growth at M, sum(per_row * (M - rows)) over rows < M, is linear between two consecutive row counts:
    # slope * M - offset over the pairs below. Walk them in order until the growth passes `free`.
    slope = offset = 0
    for rows, per_row in sorted(scaling):
        if slope * rows - offset > free:
            break
        slope += per_row
        offset += per_row * rows
    return (free + offset) // slope


def gpu_views(
    gpu: GpuResult,
    entries: Sequence[ManifestEntry],
    views_at: dict[DeviceKey, list[DeclarationView]],
    owners: Sequence[OwnerView],
    limits: Limits = NO_LIMITS,
) -> list[GpuView]:
    """`views_at`: the declaration views by their placement's device key. Only the GPUs a live manifest sits on: a
    GPU no engine of this exporter uses is another exporter's (or nobody's) to report."""
    result = []
    # Grouped in one pass each, not one pass per device (docs/decisions/0004-engine-page-scanner.md).
    owners_at = _by_place((o.placement, o) for o in owners)
    live = [e.manifest for e in entries if e.manifest is not None and e.live]
    workers_at = _by_place((placement(m, gpu), m) for m in live)
    limits_at = _by_place((w.placement, w) for w in limits.workers)
    for device in gpu.devices:
        mine, held, workers = _on(views_at, device), _on(owners_at, device), _on(workers_at, device)
        if not workers:
            continue
        pids = {m.process.pid for m in workers}
        listed = gpu.processes.get(device.index, {}) if device.index in gpu.comparable else {}
        unexplained_growth = sum(o.unexplained_growth_bytes for o in held)
        resident = sum(o.resident_bytes for o in held)
        projected_peak = device.occupied + sum(v.headroom_needed for v in mine) - resident + unexplained_growth
        headroom, binding = device.total - projected_peak, BINDING_DEVICE
        safe = safe_max_num_seqs(device.total - device.occupied, mine, held)
        for limit in _on(limits_at, device):
            if limit.headroom_bytes < headroom:
                headroom, binding = limit.headroom_bytes, BINDING_WORKER
            safe = _smaller(safe, _worker_safe(limit, mine, held))
        pods = {m.pod for m in workers}
        result.append(
            GpuView(
                memory=device,
                source=gpu.source or "",
                projected_peak=projected_peak,
                safe_max_num_seqs=safe,
                processes={pid: listed[pid] for pid in sorted(pids) if pid in listed},
                declarations=len(mine),
                unexplained_growth=unexplained_growth,
                resident=resident,
                headroom=headroom,
                binding=binding,
                declared_ceiling=sum(v.ceiling_bytes for v in mine),
                pod=pods.pop() if len(pods) == 1 else PodInfo(),
                other_processes=other_processes(gpu, device, pids),
            )
        )
    return result


def other_processes(gpu: GpuResult, device: GpuMemory, pids: set[int]) -> int | None:
    """Compute processes on `device` that no manifest of this exporter accounts for: by pid where NVML's pids are
    comparable with the manifests', else by count (NVML lists host pids; a pod sees its own); None: not read."""
    listed = gpu.processes.get(device.index)
    if listed is None:
        return None
    if device.index in gpu.comparable:
        return len(set(listed) - pids)
    return max(0, len(listed) - len(pids))


def _worker_safe(limit: WorkerLimit, views: Sequence[DeclarationView], owners: Sequence[OwnerView]) -> int | None:
    group = limit.group
    mine = [v for v in views if (v.placed.engine, v.placed.placement, v.placed.pod) == group]
    held = [o for o in owners if (o.key, o.placement, o.pod) == group]
    return safe_max_num_seqs(limit.room_bytes, mine, held)


def _smaller(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


OK = ObservedState.OK
P = TypeVar("P")


def _by_place(items: Iterable[tuple[Placement, P]]) -> dict[DeviceKey, list[P]]:
    groups: dict[DeviceKey, list[P]] = {}
    for where, item in items:
        groups.setdefault(where.key, []).append(item)
    return groups


def _on(groups: dict[DeviceKey, list[P]], device: GpuMemory) -> list[P]:
    """The items `Placement.on` puts on `device`."""
    return [item for key in device_keys(device) for item in groups.get(key, ())]


def _usable(entries: Sequence[ManifestEntry], now: float) -> list[Manifest]:
    """The live manifests whose observation is fresh enough to use."""
    return [e.manifest for e in entries if e.live and e.manifest and worker_state(e.manifest, now) is OK]


def _mark_dropped(entries: Sequence[ManifestEntry], dropped: Sequence[ManifestEntry]) -> list[ManifestEntry]:
    """The entries, the dropped ones saying so (for the landing page; their state stays live)."""
    paths = {e.path for e in dropped}
    note = "; left out of the metrics: over --max-series or --max-label-bytes"
    return [
        replace(e, verdict=Verdict(e.verdict.state, e.verdict.why + note)) if e.path in paths else e for e in entries
    ]


def build_snapshot(
    entries: Sequence[ManifestEntry],
    pages: Sequence[PageResult],
    gpu: GpuResult,
    *,
    cap: SeriesCap = NO_CAP,
    manifest_folder: str = "",
    manifest_folder_error: str | None = None,
    manifest_folder_state: FolderState = FolderState.OK,
    manifest_errors_total: dict[str, int] | None = None,
    page_errors_total: dict[tuple[str, str], int] | None = None,
    nvml_errors_total: dict[str, int] | None = None,
    observation_errors_total: dict[str, int] | None = None,
    duration_s: float = 0.0,
    taken_at: float = 0.0,
    cache: DeclaredCache | None = None,
    workers: dict[EngineKey, Running] | None = None,
) -> Snapshot:
    """The same inputs give the same snapshot; `cache` (the last scrapes' work) only saves rebuilding what they
    share. `taken_at` is also the time observations are judged at. `workers`: each engine's running count from its
    workers' step records (`running.engines_running`)."""
    cache = DeclaredCache() if cache is None else cache
    workers = workers or {}
    on_pages = page_counts(pages)
    running = running_counts(on_pages, workers)
    limited = limit_series(entries, running, cap)
    kept, dropped = limited.kept, limited.dropped
    declared_now = cache.declared(_placed(kept, gpu, cache))
    views = declaration_views(declared_now, running, workers)
    observed = observe(kept, running, gpu, taken_at)
    # The cap limits series, not truth: left-out manifests still count in their GPU's projected peak.
    unexported = declaration_views(cache.declared(_placed(dropped, gpu, cache), exported=False), running)
    cache.end_scrape()
    views_at = {key: [views[i] for i in at] for key, at in declared_now.by_device.items()}
    for view in unexported:  # the same device keys as placements give them
        views_at.setdefault(view.placed.placement.key, []).append(view)
    unexported_owners = observe(dropped, running, gpu, taken_at).owners if dropped else ()
    all_owners = [*observed.owners, *unexported_owners]
    limits = worker_limits(_usable(kept, taken_at), gpu, observed.owners)
    binding = worker_limits(_usable(entries, taken_at), gpu, all_owners) if dropped else limits
    return Snapshot(
        manifests=tuple(_mark_dropped(entries, dropped) if dropped else entries),
        declared=declared_now,
        declarations=tuple(views),
        engines=tuple(engine_views(kept, running, limited.page_engines, workers, on_pages)),
        pages=tuple(pages),
        gpus=tuple(gpu_views(gpu, entries, views_at, all_owners, binding)),
        gpu=gpu,
        manifest_errors_total=dict(manifest_errors_total or {}),
        page_errors_total=dict(page_errors_total or {}),
        nvml_errors_total=dict(nvml_errors_total or {}),
        manifest_folder=manifest_folder,
        manifest_folder_error=manifest_folder_error,
        duration_s=duration_s,
        taken_at=taken_at,
        observed=observed,
        limits=limits,
        budgets=engine_budgets(kept, gpu),
        observation_errors_total=dict(observation_errors_total or {}),
        series_dropped=tuple(sorted(e.path for e in dropped)),
        engines_dropped=limited.page_engines_dropped,
        manifest_folder_state=manifest_folder_state,
    )
