"""The snapshot: one scrape's inputs combined into the figures every output reads (pure, no I/O).

Inputs are records (`ManifestEntry`, `PageResult`, `GpuResult`) that `inputs` gathers; the snapshot holds one view
per live declaration, engine and GPU: ceiling and estimate, running count, projected peak, headroom and safe
max_num_seqs. `families` turns it into metric families, `landing` into the landing page. The same inputs always give
the same snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from kv_exporter.gpu import GpuMemory
from kv_exporter.manifest import Declaration, Manifest, PodInfo
from kv_exporter.sidecar.budget import NO_CAP, SeriesCap, limit_series
from kv_exporter.sidecar.engine_page import EngineKey
from kv_exporter.sidecar.liveness import State, Verdict
from kv_exporter.sidecar.observed import Observed, OwnerView, observe
from kv_exporter.sidecar.records import GpuResult, ManifestEntry, PageResult, engine_key, first_rank, placement


@dataclass(frozen=True)
class DeclarationView:
    """One live declaration with its figures at the engine's max_num_seqs and at the live running count."""

    model_name: str
    stage: int
    engine: int
    gpu: str
    uuid: str
    pod: PodInfo
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
    pod: PodInfo  # of its first-rank manifest; unknown for an engine only a page shows
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
    safe_max_num_seqs: int | None  # None: nothing on this GPU scales with max_num_seqs
    processes: dict[int, int]  # matched manifest pid -> NVML used bytes
    declarations: int
    unexplained_growth: int  # the part of the projected peak that observation adds to the declarations' growth

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
    observed: Observed = field(default_factory=Observed)
    observation_errors_total: dict[str, int] = field(default_factory=dict)
    series_dropped: tuple[str, ...] = ()  # live manifests left out by the series cap (paths)
    engines_dropped: int = 0  # engines only a page shows, left out by the series cap

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
                    pod=m.pod,
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


def engine_views(
    entries: Sequence[ManifestEntry], running: RunningCounts, page_engines: Iterable[EngineKey] = ()
) -> list[EngineView]:
    """The engines of the live manifests in `entries`, and `page_engines`: ones only a page shows."""
    workers: dict[EngineKey, list[Manifest]] = {}
    for entry in entries:
        if entry.manifest is not None and entry.live:
            workers.setdefault(engine_key(entry.manifest), []).append(entry.manifest)
    views = []
    for key in sorted(set(workers) | set(page_engines)):
        known = running.get(key)
        mine = workers.get(key, [])
        views.append(
            EngineView(
                key=key,
                pod=first_rank(mine).pod if mine else PodInfo(),
                up=known is not None,
                running=known[0] if known else None,
                max_num_seqs=max((m.max_num_seqs for m in mine), default=None),
                manifests=len(mine),
                target=known[1] if known else None,
            )
        )
    return views


def safe_max_num_seqs(
    device: GpuMemory, views: Sequence[DeclarationView], owners: Sequence[OwnerView] = ()
) -> int | None:
    """Largest M with used + sum(bytes_per_row * max(0, M - estimated rows)) <= total, over this GPU's
    max_num_seqs-driven declarations and the owners whose unexplained bytes grow with running sequences (every
    engine on the GPU at the same M); None when there are none."""
    # (bytes per row, rows now) pairs: the search below evaluates peak() ~30 times per GPU.
    scaling = [
        (v.declaration.bytes_per_row, v.estimate_rows) for v in views if v.declaration.rows.scales_with_max_num_seqs
    ] + [(o.unexplained_per_sequence, o.running or 0) for o in owners if o.unexplained_per_sequence]
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


def gpu_views(
    gpu: GpuResult, entries: Sequence[ManifestEntry], views: Views, owners: Sequence[OwnerView]
) -> list[GpuView]:
    result = []
    # Grouped in one pass each, not one pass per device (docs/benchmarks.md, target 1).
    views_at = _by_place(((v.uuid, _index(v.gpu)), v) for v in views)
    owners_at = _by_place(((o.uuid, _index(o.gpu)), o) for o in owners)
    pids_at = _by_place((_place(e.manifest, gpu), e.manifest.process.pid) for e in entries if e.manifest and e.live)
    for device in gpu.devices:
        mine = _placed(views_at, device)
        held = _placed(owners_at, device)
        pids = set(_placed(pids_at, device))
        listed = gpu.processes.get(device.index, {})
        unexplained_growth = sum(o.unexplained_growth_bytes for o in held)
        result.append(
            GpuView(
                memory=device,
                source=gpu.source or "",
                projected_peak=device.used + sum(v.headroom_needed for v in mine) + unexplained_growth,
                safe_max_num_seqs=safe_max_num_seqs(device, mine, held),
                processes={pid: listed[pid] for pid in sorted(pids) if pid in listed},
                declarations=len(mine),
                unexplained_growth=unexplained_growth,
            )
        )
    return result


def _index(gpu_label: str) -> int | None:
    return None if gpu_label == "" else int(gpu_label)


_Place = tuple[str, int | None]  # (UUID or "", index): what `records.on_device` matches a device by


def _place(manifest: Manifest, gpu: GpuResult) -> _Place:
    index, uuid = placement(manifest, gpu)
    return uuid, index


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
    manifest_errors_total: dict[str, int] | None = None,
    page_errors_total: dict[tuple[str, str], int] | None = None,
    nvml_errors_total: dict[str, int] | None = None,
    observation_errors_total: dict[str, int] | None = None,
    duration_s: float = 0.0,
    taken_at: float = 0.0,
) -> Snapshot:
    """Pure: the same inputs give the same snapshot. `taken_at` is also the time observations are judged at."""
    running = running_counts(pages)
    limited = limit_series(entries, running, cap)
    kept, dropped = limited.kept, limited.dropped
    views = declaration_views(kept, running, gpu)
    observed = observe(kept, running, gpu, taken_at)
    # The cap limits series, not truth: left-out manifests still count in their GPU's projected peak.
    unexported = declaration_views(dropped, running, gpu) if dropped else []
    unexported_owners = observe(dropped, running, gpu, taken_at).owners if dropped else ()
    return Snapshot(
        manifests=tuple(_mark_dropped(entries, dropped) if dropped else entries),
        declarations=tuple(views),
        engines=tuple(engine_views(kept, running, limited.page_engines)),
        pages=tuple(pages),
        gpus=tuple(gpu_views(gpu, entries, [*views, *unexported], [*observed.owners, *unexported_owners])),
        gpu=gpu,
        manifest_errors_total=dict(manifest_errors_total or {}),
        page_errors_total=dict(page_errors_total or {}),
        nvml_errors_total=dict(nvml_errors_total or {}),
        manifest_folder=manifest_folder,
        manifest_folder_error=manifest_folder_error,
        duration_s=duration_s,
        taken_at=taken_at,
        observed=observed,
        observation_errors_total=dict(observation_errors_total or {}),
        series_dropped=tuple(sorted(e.path for e in dropped)),
        engines_dropped=limited.page_engines_dropped,
    )
