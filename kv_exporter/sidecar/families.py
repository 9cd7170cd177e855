"""Prometheus metric families from a `Snapshot`: the public metric names and labels (docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kv_exporter.sidecar.buildinfo import build_info
from kv_exporter.sidecar.declared import Declared, PlacedDeclaration, declared
from kv_exporter.sidecar.exposition import CounterRows, GaugeRows
from kv_exporter.sidecar.labels import (
    DECLARATION_LABELS,
    ENGINE_GPU_LABELS,
    ENGINE_LABELS,
    INFO_EXTRA_LABELS,
    OWNER_LABELS,
)
from kv_exporter.sidecar.labels import (
    engine_labels as _engine,
)
from kv_exporter.sidecar.labels import (
    pod_labels as _pod,
)
from kv_exporter.sidecar.memory_families import gpu_families, limit_families
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
        per_row = GaugeRows("model_local_kv_bytes_per_row", "Bytes in one row.", DECLARATION_LABELS)
        ceiling = GaugeRows(
            "model_local_kv_ceiling_bytes",
            "Bytes at the engine's max_num_seqs rows (rows_fixed for driver=fixed).",
            DECLARATION_LABELS,
        )
        positions = GaugeRows(
            "model_local_kv_capacity_positions", "Positions one row can physically hold.", DECLARATION_LABELS
        )
        info = GaugeRows(
            "model_local_kv_declaration_info",
            "Declaration metadata (value 1).",
            DECLARATION_LABELS + INFO_EXTRA_LABELS,
        )
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
        estimate = GaugeRows(
            "model_local_kv_estimated_bytes",
            "Bytes at the sequences the engine runs now (its workers' latest step, else its page), capped at "
            "max_num_seqs (rows_fixed for driver=fixed; 0 rows for driver=max_num_seqs while that is unknown).",
            DECLARATION_LABELS,
        )
        peak = GaugeRows(
            "model_local_kv_estimated_peak_bytes",
            "Bytes at the most sequences any step of the engine's workers ran over the last --running-window "
            "seconds, capped at max_num_seqs (rows_fixed for driver=fixed); absent where no worker keeps a step "
            "record.",
            DECLARATION_LABELS,
        )
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
    running = GaugeRows(
        "model_local_kv_running_sequences",
        "Sequences the engine runs now: its workers' latest step (a step that ended over a second ago: 0), or, for "
        "workers that keep no step record, its metrics page's running count at the scrape.",
        ENGINE_LABELS,
    )

    max_seqs = GaugeRows("model_local_kv_max_num_seqs", "max_num_seqs from its manifests.", ENGINE_LABELS)
    up = GaugeRows("model_local_kv_engine_up", "1 if its running count was read this scrape.", ENGINE_LABELS)
    manifests = GaugeRows(
        "model_local_kv_engine_manifests",
        "Live valid manifests matched to this engine (0: the engine runs but declares nothing here).",
        ENGINE_LABELS,
    )
    labelled = [((*_engine(view.key), *_pod(view.pod)), view) for view in engines]
    for labels, view in labelled:
        if view.running is not None:
            running.add_metric(labels, view.running)
        if view.max_num_seqs is not None:
            max_seqs.add_metric(labels, view.max_num_seqs)
        up.add_metric(labels, int(view.up))
        manifests.add_metric(labels, view.manifests)
    page_up = GaugeRows("model_local_kv_engine_page_up", "1 if the page was fetched and read.", ("target",))
    for page in pages:
        page_up.add_metric((page.target,), int(page.page is not None))
    most, state, difference = running_families(labelled, ENGINE_LABELS)
    return [running, most, max_seqs, up, manifests, state, difference, page_up]


def observed_families(observed: Observed) -> list[Metric]:
    held = GaugeRows(
        "model_local_kv_observed_bytes",
        "Storage the owner's live model-local KV holds at the engine's last observation (transformers caches, KV in a "
        "declaring owner's own state, known cache classes' buffers), each storage counted "
        "once, summed over the engine's workers on this GPU (0: a declaring owner holding nothing).",
        OWNER_LABELS,
    )
    peak = GaugeRows(
        "model_local_kv_observed_peak_bytes",
        "The most the owner's live model-local KV held at any instant between the engine's last two "
        "observations (caches a step makes and frees included), each storage counted once, summed over its workers; "
        "absent where a worker does not follow it (KV_EXPORTER_OBSERVE_PEAK=0).",
        OWNER_LABELS,
    )
    caches = GaugeRows("model_local_kv_observed_caches", "Live cache objects the owner holds.", OWNER_LABELS)
    unexplained = GaugeRows(
        "model_local_kv_unexplained_bytes",
        "max(0, observed peak - the owner's declared ceiling at max_num_seqs), the observed figure at the sample "
        "where the peak is not followed; all of it for an owner declaring nothing.",
        OWNER_LABELS,
    )
    for owner in observed.owners:
        where = owner.placement
        labels: tuple[str, ...] = (*_engine(owner.key), owner.owner, where.gpu, where.uuid, *_pod(owner.pod))
        held.add_metric(labels, owner.observed_bytes)
        if owner.peak_followed:  # else the sample's figure, already above: no peak is claimed
            peak.add_metric(labels, owner.peak_bytes)
        caches.add_metric(labels, owner.caches)
        unexplained.add_metric(labels, owner.unexplained_bytes)
    unreadable = GaugeRows(
        "model_local_kv_observed_unreadable_caches",
        "Live caches of the owner its workers could not read, by reason (no_layers, layers_raised, not_a_tensor, "
        "no_storage, not_followed): left out of its observed figures.",
        (*OWNER_LABELS, "reason"),
    )
    for bad in observed.unreadable:
        labels = (*_engine(bad.key), bad.owner, bad.placement.gpu, bad.placement.uuid, *_pod(bad.pod), bad.reason)
        unreadable.add_metric(labels, bad.caches)
    state = GaugeRows(
        "model_local_kv_observation_state",
        "1 for the state of the engine's observation (the worst of its workers'), 0 for the others: ok, off, "
        "unavailable, failing, stale (the sampler stopped), absent (the manifest has none), rejected (unreadable, or "
        "dated ahead of the sidecar's clock).",
        (*ENGINE_LABELS, "state"),
    )
    age = GaugeRows(
        "model_local_kv_observation_age_seconds",
        "Seconds since the oldest usable sample of the engine's workers.",
        ENGINE_LABELS,
    )
    for engine in observed.engines:
        labels = (*_engine(engine.key), *_pod(engine.pod))
        for name in ObservedState:
            state.add_metric((*labels, name.value), int(name is engine.state))
        if engine.age_s is not None:
            age.add_metric(labels, engine.age_s)
    return [held, peak, caches, unexplained, unreadable, state, age, *_cuda_families(observed)]


def _cuda_families(observed: Observed) -> list[Metric]:
    """The workers' allocator figures (observe/cuda.py), and why a worker has none."""
    allocated = GaugeRows(
        "model_local_kv_observed_cuda_allocated_bytes",
        "torch.cuda.memory_allocated() of the engine's workers on this GPU, at their last observation.",
        ENGINE_GPU_LABELS,
    )
    reserved = GaugeRows(
        "model_local_kv_observed_cuda_reserved_bytes",
        "torch.cuda.memory_reserved() of the engine's workers on this GPU, at their last observation.",
        ENGINE_GPU_LABELS,
    )
    peak = GaugeRows(
        "model_local_kv_observed_cuda_peak_bytes",
        "The most torch's allocator held on this GPU since its peak was last reset (by vLLM's profiler at start-up; "
        "kv-exporter never resets it), summed over the engine's workers.",
        ENGINE_GPU_LABELS,
    )
    high_water = GaugeRows(
        "model_local_kv_observed_cuda_high_water_bytes",
        "At most the most torch's allocator held between the engine's last two observations: its peak where that "
        "rose in between (exact), else bounded by the peak and by what was allocated in between.",
        ENGINE_GPU_LABELS,
    )
    floor = GaugeRows(
        "model_local_kv_observed_cuda_high_water_floor_bytes",
        "At least the most torch's allocator held between the engine's last two observations (the larger of the two "
        "samples' allocated, or the risen peak); equal to the high-water figure where that is exact.",
        ENGINE_GPU_LABELS,
    )
    warm = GaugeRows(
        "model_local_kv_observed_cuda_warm_allocated_bytes",
        "torch.cuda.memory_allocated() when the engine's warm-up ended (its KV budget sized, its graphs captured).",
        ENGINE_GPU_LABELS,
    )
    growth = GaugeRows(
        "model_local_kv_observed_cuda_unexplained_growth_bytes",
        "Allocated now minus at the end of warm-up, less what the observed model-local KV grew by in that time: "
        "memory no declaration and no observed cache explains (negative where less is held than after warm-up).",
        ENGINE_GPU_LABELS,
    )
    retries = CounterRows(
        "model_local_kv_observed_cuda_alloc_retries",
        "Allocations torch's allocator retried after freeing its cache (num_alloc_retries): memory pressure.",
        ENGINE_GPU_LABELS,
    )
    ooms = CounterRows(
        "model_local_kv_observed_cuda_ooms",
        "Allocations torch's allocator failed for good: out-of-memory errors raised in the worker (num_ooms).",
        ENGINE_GPU_LABELS,
    )
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
    unavailable = GaugeRows(
        "model_local_kv_observed_cuda_unavailable",
        "Workers of the engine whose observation has no allocator figures, by reason: not_cuda (a CPU worker), "
        "not_initialised, not_attached (model not loaded yet), no_index, stats_failed, refused (figures torch's "
        "allocator could never give together, counted in model_local_kv_observation_errors_total).",
        (*ENGINE_LABELS, "reason"),
    )
    for missing in observed.cuda_unavailable:
        unavailable.add_metric((*_engine(missing.key), *_pod(missing.pod), missing.reason), missing.workers)
    return [allocated, reserved, peak, high_water, floor, warm, growth, retries, ooms, unavailable]


def exporter_families(snapshot: Snapshot) -> list[Metric]:
    nvml_up = GaugeMetricFamily(
        "model_local_kv_nvml_up",
        "1 if the GPU reader (NVML or simulated) answered this scrape.",
        value=int(snapshot.gpu.up),
    )
    manifests = GaugeRows("model_local_kv_manifests", "Manifest files by state.", ("state",))
    for state, count in snapshot.manifest_counts().items():
        manifests.add_metric((state.value,), count)
    folder = GaugeRows(
        "model_local_kv_manifest_folder_state",
        "1 for what listing the manifest folder (--manifest-dir) found this scrape, 0 for the others: ok, missing, "
        "unreadable (permissions, I/O), not_a_folder.",
        ("state",),
    )
    for folder_state in FolderState:
        folder.add_metric((folder_state.value,), int(folder_state is snapshot.manifest_folder_state))
    manifest_errors = _counter(
        "model_local_kv_manifest_errors",
        "Invalid manifest file versions seen, by reason.",
        ("reason",),
        sorted(((reason,), count) for reason, count in snapshot.manifest_errors_total.items()),
    )
    page_errors = _counter(
        "model_local_kv_engine_page_errors",
        "Failed engine page reads, by target and reason.",
        ("target", "reason"),
        _by_configured_target(snapshot.page_errors_total),
    )
    nvml_errors = _counter(
        "model_local_kv_nvml_errors",
        "Failed GPU reader calls, by reason.",
        ("reason",),
        sorted(((reason,), count) for reason, count in snapshot.nvml_errors_total.items()),
    )
    observation_errors = _counter(
        "model_local_kv_observation_errors",
        "Observations (or their allocator figures alone) refused and never exported as figures, by reason: "
        "unreadable ones once per file version, stale ones once per sample, ones from a dead process once per file "
        "version.",
        ("reason",),
        sorted(((reason,), count) for reason, count in snapshot.observation_errors_total.items()),
    )
    dropped = GaugeMetricFamily(
        "model_local_kv_series_limit_dropped_manifests",
        "Live manifests left out of this page because their series would exceed --max-series or "
        "--max-label-bytes (each left out alone, in file-name order).",
        value=len(snapshot.series_dropped),
    )
    engines_dropped = GaugeMetricFamily(
        "model_local_kv_series_limit_dropped_engines",
        "Engines that only an engine page shows (no live manifest declares them) left out of this page because "
        "their series would exceed --max-series or --max-label-bytes.",
        value=snapshot.engines_dropped,
    )
    duration = GaugeMetricFamily(
        "model_local_kv_scrape_duration_seconds", "Seconds the collection took.", value=snapshot.duration_s
    )
    info = build_info()
    build = GaugeRows(
        "model_local_kv_exporter_build_info",
        "kv-exporter's version, source revision and Python version (value 1).",
        ("version", "revision", "pythonversion"),
    )
    build.add_metric((info.version, info.revision, info.python_version), 1)
    errors = [manifest_errors, page_errors, nvml_errors, observation_errors]
    return [nvml_up, manifests, folder, *errors, dropped, engines_dropped, duration, build]


def _counter(
    name: str, doc: str, labels: tuple[str, ...], counts: Iterable[tuple[tuple[str, ...], int]]
) -> CounterMetricFamily:
    """Series in the order of `counts`."""
    counter = CounterMetricFamily(name, doc, labels=list(labels))
    for label_values, count in counts:
        counter.add_metric(label_values, count)
    return counter


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
