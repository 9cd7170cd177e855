"""Prometheus metric families from a `Snapshot`, each made from its row of `metrics_table` (docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, Metric

from kv_exporter.sidecar import metrics_table as table
from kv_exporter.sidecar.buildinfo import build_info
from kv_exporter.sidecar.declared import Declared, PlacedDeclaration, declared
from kv_exporter.sidecar.labels import (
    engine_labels as _engine,
)
from kv_exporter.sidecar.labels import (
    pod_labels as _pod,
)
from kv_exporter.sidecar.memory_families import gpu_families, limit_families
from kv_exporter.sidecar.metric_spec import MetricSpec
from kv_exporter.sidecar.observed import Observed, ObservedState
from kv_exporter.sidecar.records import FolderState, PageResult
from kv_exporter.sidecar.running_families import running_families
from kv_exporter.sidecar.snapshot import DeclarationView, EngineView, Snapshot

# -- metric families -----------------------------------------------------------------------------------------


def _declaration_labels(placed: PlacedDeclaration) -> tuple[str, ...]:
    d, where = placed.declaration, placed.placement
    engine = _engine(placed.engine)
    return (*engine, d.owner, d.name, d.scope.value, d.rows.value, where.gpu, where.uuid, *_pod(placed.pod))


class _Declared:
    """The declaration families of one `Declared`: four that no running count moves, made once (frozen), and the
    label sets the estimate family repeats on every scrape."""

    def __init__(self, declared: Declared) -> None:
        self.declared = declared
        # Ranks of one engine sharing a GPU would repeat a label set: their bytes add up under one series.
        groups: dict[tuple[str, ...], list[int]] = {}
        for index, placed in enumerate(declared.ordered):
            groups.setdefault(_declaration_labels(placed), []).append(index)
        self.groups = [(labels, tuple(indices)) for labels, indices in groups.items()]
        per_row = table.BYTES_PER_ROW.rows()
        ceiling = table.CEILING.rows()
        positions = table.CAPACITY_POSITIONS.rows()
        info = table.DECLARATION_INFO.rows()
        ordered = declared.ordered
        for labels, at in self.groups:
            first = ordered[at[0]].declaration
            per_row.add_metric(labels, first.bytes_per_row)
            ceiling.add_metric(labels, sum(ordered[i].ceiling_bytes for i in at))
            positions.add_metric(labels, first.physical_capacity_positions)
            extra = (first.dtype, first.capacity_source, str(first.rows_fixed), first.rows_reason)
            info.add_metric((*labels, *extra, first.allocation_note or ""), 1)
        self.unmoving = [f.freeze() for f in (per_row, ceiling, positions, info)]

    def families(self, views: Sequence[DeclarationView]) -> list[Metric]:
        """`views`: the declarations of this `Declared`, in its order, at this scrape's running counts."""
        estimate = table.ESTIMATED.rows()
        peak = table.ESTIMATED_PEAK.rows()
        held = [v.estimate_bytes for v in views]
        most = [v.peak_bytes for v in views]
        for labels, at in self.groups:
            estimate.add_metric(labels, held[at[0]] if len(at) == 1 else sum(held[i] for i in at))
            peaks = [most[i] for i in at]
            if None not in peaks:
                peak.add_metric(labels, sum(peaks))  # type: ignore[arg-type]  # no None left
        per_row, ceiling, positions, info = self.unmoving
        return [per_row, ceiling, estimate, peak, positions, info]


class DeclarationFamilies:
    """The declaration families of a snapshot, reusing the last one's unmoving four while its `Declared` is the same
    object (the snapshot's cache keeps it so while no manifest changes what it declares)."""

    def __init__(self) -> None:
        self._last = _Declared(declared(()))

    def __call__(self, snapshot: Snapshot) -> list[Metric]:
        last = self._last
        if last.declared is not snapshot.declared:
            self._last = last = _Declared(snapshot.declared)
        return last.families(snapshot.declarations)


def engine_families(engines: Sequence[EngineView], pages: Sequence[PageResult]) -> list[Metric]:
    running = table.RUNNING.rows()

    max_seqs = table.MAX_NUM_SEQS.rows()
    up = table.ENGINE_UP.rows()
    manifests = table.ENGINE_MANIFESTS.rows()
    labelled = [((*_engine(view.key), *_pod(view.pod)), view) for view in engines]
    for labels, view in labelled:
        if view.running is not None:
            running.add_metric(labels, view.running)
        if view.max_num_seqs is not None:
            max_seqs.add_metric(labels, view.max_num_seqs)
        up.add_metric(labels, int(view.up))
        manifests.add_metric(labels, view.manifests)
    page_up = table.ENGINE_PAGE_UP.rows()
    for page in pages:
        page_up.add_metric((page.target,), int(page.page is not None))
    most, state, difference = running_families(labelled)
    return [running, most, max_seqs, up, manifests, state, difference, page_up]


def observed_families(observed: Observed) -> list[Metric]:
    held = table.OBSERVED_BYTES.rows()
    peak = table.OBSERVED_PEAK.rows()
    caches = table.OBSERVED_CACHES.rows()
    unexplained = table.UNEXPLAINED.rows()
    for owner in observed.owners:
        where = owner.placement
        labels: tuple[str, ...] = (*_engine(owner.key), owner.owner, where.gpu, where.uuid, *_pod(owner.pod))
        held.add_metric(labels, owner.observed_bytes)
        if owner.peak_followed:  # else the sample's figure, already above: no peak is claimed
            peak.add_metric(labels, owner.peak_bytes)
        caches.add_metric(labels, owner.caches)
        unexplained.add_metric(labels, owner.unexplained_bytes)
    unreadable = table.UNREADABLE_CACHES.rows()
    for bad in observed.unreadable:
        labels = (*_engine(bad.key), bad.owner, bad.placement.gpu, bad.placement.uuid, *_pod(bad.pod), bad.reason)
        unreadable.add_metric(labels, bad.caches)
    state = table.OBSERVATION_STATE.rows()
    age = table.OBSERVATION_AGE.rows()
    for engine in observed.engines:
        labels = (*_engine(engine.key), *_pod(engine.pod))
        for name in ObservedState:
            state.add_metric((*labels, name.value), int(name is engine.state))
        if engine.age_s is not None:
            age.add_metric(labels, engine.age_s)
    return [held, peak, caches, unexplained, unreadable, state, age, *_cuda_families(observed)]


def _cuda_families(observed: Observed) -> list[Metric]:
    """The workers' allocator figures (observe/cuda.py), and why a worker has none."""
    allocated = table.CUDA_ALLOCATED.rows()
    reserved = table.CUDA_RESERVED.rows()
    peak = table.CUDA_PEAK.rows()
    high_water = table.CUDA_HIGH_WATER.rows()
    floor = table.CUDA_HIGH_WATER_FLOOR.rows()
    warm = table.CUDA_WARM_ALLOCATED.rows()
    growth = table.CUDA_UNEXPLAINED_GROWTH.rows()
    retries = table.CUDA_ALLOC_RETRIES.rows()
    ooms = table.CUDA_OOMS.rows()
    for cuda in observed.cuda:
        labels = (*_engine(cuda.key), cuda.placement.gpu, cuda.placement.uuid, *_pod(cuda.pod))
        allocated.add_metric(labels, cuda.allocated_bytes)
        reserved.add_metric(labels, cuda.reserved_bytes)
        if not cuda.detailed:  # a version 3 worker wrote only those two
            continue
        peak.add_metric(labels, cuda.peak_bytes)
        high_water.add_metric(labels, cuda.high_water_bytes)
        floor.add_metric(labels, cuda.high_water_floor_bytes)
        retries.add_metric(labels, cuda.alloc_retries)
        ooms.add_metric(labels, cuda.ooms)
        if cuda.warm_allocated_bytes is not None and cuda.unexplained_growth_bytes is not None:
            warm.add_metric(labels, cuda.warm_allocated_bytes)
            growth.add_metric(labels, cuda.unexplained_growth_bytes)
    unavailable = table.CUDA_UNAVAILABLE.rows()
    for missing in observed.cuda_unavailable:
        unavailable.add_metric((*_engine(missing.key), *_pod(missing.pod), missing.reason), missing.workers)
    return [allocated, reserved, peak, high_water, floor, warm, growth, retries, ooms, unavailable]


def exporter_families(snapshot: Snapshot) -> list[Metric]:
    nvml_up = table.NVML_UP.single(int(snapshot.gpu.up))
    manifests = table.MANIFESTS.rows()
    for state, count in snapshot.manifest_counts().items():
        manifests.add_metric((state.value,), count)
    folder = table.MANIFEST_FOLDER_STATE.rows()
    for folder_state in FolderState:
        folder.add_metric((folder_state.value,), int(folder_state is snapshot.manifest_folder_state))
    errors = [
        _counter(table.MANIFEST_ERRORS, _by_reason(snapshot.manifest_errors_total)),
        _counter(table.ENGINE_PAGE_ERRORS, _by_configured_target(snapshot.page_errors_total)),
        _counter(table.NVML_ERRORS, _by_reason(snapshot.nvml_errors_total)),
        _counter(table.OBSERVATION_ERRORS, _by_reason(snapshot.observation_errors_total)),
    ]
    dropped = table.DROPPED_MANIFESTS.single(len(snapshot.series_dropped))
    engines_dropped = table.DROPPED_ENGINES.single(snapshot.engines_dropped)
    duration = table.SCRAPE_DURATION.single(snapshot.duration_s)
    info = build_info()
    build = table.BUILD_INFO.rows()
    build.add_metric((info.version, info.revision, info.python_version), 1)
    return [nvml_up, manifests, folder, *errors, dropped, engines_dropped, duration, build]


def _counter(spec: MetricSpec, counts: Iterable[tuple[tuple[str, ...], int]]) -> CounterMetricFamily:
    """Series in the order of `counts`."""
    counter = CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels))
    for label_values, count in counts:
        counter.add_metric(label_values, count)
    return counter


def _by_reason(counts: dict[str, int]) -> list[tuple[tuple[str, ...], int]]:
    return sorted(((reason,), count) for reason, count in counts.items())


def _by_configured_target(counts: dict[tuple[str, str], int]) -> list[tuple[tuple[str, ...], int]]:
    """Targets in the order they were configured (the order the counter holds them), reasons sorted within each:
    sorting by URL would order targets by their ports, which differ from one start to the next."""
    position = {target: index for index, target in enumerate(dict.fromkeys(target for target, _ in counts))}
    return sorted(counts.items(), key=lambda item: (position[item[0][0]], item[0][1]))


def families(snapshot: Snapshot, declarations: DeclarationFamilies | None = None) -> list[Metric]:
    """`declarations`: the last scrape's declaration families, to reuse what did not change."""
    return [
        *(declarations or DeclarationFamilies())(snapshot),
        *engine_families(snapshot.engines, snapshot.pages),
        *gpu_families(snapshot.gpus),
        *observed_families(snapshot.observed),
        *limit_families(snapshot),
        *exporter_families(snapshot),
    ]
