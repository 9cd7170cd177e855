"""The series cap: how much of a page what others write may fill, in series and in label text (pure, no I/O).

What a declarer writes decides how many series a live manifest adds and how long their label values are; what an
engine page lists decides which engines appear that no manifest declares. Per-GPU and per-page series are bounded by
the devices and the configuration, so only these two count. Each counts twice: its series against `--max-series`,
and the bytes of their label values (as the page spells them: escaped, UTF-8) against `--max-label-bytes`. With
strings at their limits (256 characters a name, 1,024 a prose field) the series cap alone would allow ~10,000
declarations of ~13 KB of text each; the label budget keeps the page to the size a real one reaches at the series
cap (docs/metrics.md, "Limits").

Manifests come first, in file-name order: the name is derived from the engine's identity and ranks
(`manifest.manifest_filename`), so it stays the same from scrape to scrape while the sampler rewrites the rest, and
nothing a declarer writes inside the file (its `written_at`, its size) moves it ahead of the others. Each manifest
that does not fit in what is left is left out whole (part of a manifest would understate its engine without saying
so) and alone: the ones after it still go in if they fit, so one runaway manifest loses its own series and nobody
else's. Engines only a page brings in (running, but declaring nothing here) then fill what is left, in key order, on
the same rule. The rule depends only on the files and the pages, so the same ones stay out scrape after scrape.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from kv_exporter.manifest import Manifest, PodInfo
from kv_exporter.observation import CUDA_DETAILS_SINCE
from kv_exporter.sidecar.engine_page import EngineKey
from kv_exporter.sidecar.limits import absent_reason
from kv_exporter.sidecar.metric_spec import Per, When
from kv_exporter.sidecar.metrics_table import rows, series
from kv_exporter.sidecar.observed import cuda_unavailable_reason
from kv_exporter.sidecar.records import ManifestEntry, engine_key

# What one entity can add, counted from the metrics table: each family with a series per declaration, per owner
# (the peak only where every worker follows it), per engine (with one series per state of a state family), per engine
# and GPU (the allocator's figures by how much the worker reports, the cap and headroom, the engine's own budget), and
# one per reason an engine (and GPU) lacks allocator figures or a cap.
SERIES_PER_DECLARATION = series(Per.DECLARATION)
SERIES_PER_OWNER = series(Per.OWNER)
_OWNER_SERIES_UNFOLLOWED = series(Per.OWNER) - series(Per.OWNER, When.PEAK_FOLLOWED)
_ENGINE_SERIES = series(Per.ENGINE) + series(Per.ENGINE_STATE)  # labelled by engine and pod
_CUDA_SERIES, _CUDA_DETAIL_SERIES, _CUDA_WARM_SERIES = (
    series(Per.ENGINE_GPU, When.CUDA),
    series(Per.ENGINE_GPU, When.CUDA_DETAILED),
    series(Per.ENGINE_GPU, When.CUDA_WARM),
)  # by engine, GPU and pod
_CAPPED_SERIES = series(Per.ENGINE_GPU, When.CAPPED)
_REASON_SERIES = series(Per.ENGINE_REASON)  # a manifest's workers share one reason
_UNREADABLE_SERIES = series(Per.OWNER_REASON)  # one per (owner, reason) the manifest lists
_ABSENT_CAP_SERIES = series(Per.ENGINE_GPU_REASON)
SERIES_PER_ENGINE = _ENGINE_SERIES + _CUDA_SERIES + _CUDA_DETAIL_SERIES + _CUDA_WARM_SERIES
# An engine only a page shows has no manifest: the engine families every engine has (running, up, manifests = 0).
SERIES_PER_PAGE_ENGINE = series(Per.ENGINE, When.ALWAYS)
# 10,000 declarations' worth: far above a real node (a few engines per GPU, a handful of caches each), and still a
# page Prometheus takes in one scrape (~13 MB of text, ~1-2 s on two cores).
DEFAULT_MAX_SERIES = SERIES_PER_DECLARATION * 10_000
# What those series' label values take with real names (~150 bytes a series: a model id, a module path, a pod name).
DEFAULT_MAX_LABEL_BYTES = 8 << 20
# The most a series line takes besides its label values: the longest name, every label name, the syntax, a value.
# So these series take at most max_label_bytes + SERIES_LINE_BYTES * max_series of the page (~21 MB by default).
SERIES_LINE_BYTES = 256
_STATE_BYTES = sum(len(value) for row in rows(Per.ENGINE_STATE) for value in row.values)


@dataclass(frozen=True)
class SeriesCap:
    max_series: int | None = None
    max_label_bytes: int | None = None


NO_CAP = SeriesCap()


@dataclass(frozen=True)
class Cost:
    """What one manifest (or page-only engine) can add to the page at most."""

    series: int
    label_bytes: int


def label_size(value: str) -> int:
    """The bytes of a label value on the page: UTF-8, with the exposition's escapes."""
    return len(value.encode()) + value.count("\\") + value.count('"') + value.count("\n")


def _pod_size(pod: PodInfo) -> int:
    return sum(label_size(part or "") for part in (pod.name, pod.namespace, pod.container))


def _engine_size(key: EngineKey, pod: PodInfo) -> int:
    return label_size(key.model_name) + len(str(key.stage)) + len(str(key.engine)) + _pod_size(pod)


# Costs by manifest object, each dropped with its object. The store hands out the same Manifest while its file is
# unchanged, so each file version is costed once: costing every live manifest on every scrape took half of
# build_snapshot's time (~5 us a declaration; docs/decisions/0006-cost-each-manifest-once.md).
_costs: dict[int, tuple[weakref.ref[Manifest], Cost]] = {}


def manifest_cost(manifest: Manifest) -> Cost:
    """The most series one live manifest can add to the page, and the bytes of their label values."""
    key = id(manifest)
    known = _costs.get(key)
    if known is not None and known[0]() is manifest:
        return known[1]
    cost = _cost(manifest)
    # The callback runs as the manifest is freed, before its id can be reused.
    _costs[key] = (weakref.ref(manifest, lambda _: _costs.pop(key, None)), cost)
    return cost


def _cost(manifest: Manifest) -> Cost:
    owners = {d.owner for d in manifest.declarations}
    owners.update(o.owner for o in (manifest.observation.owners if manifest.observation else ()))
    engine = _engine_size(engine_key(manifest), manifest.pod)
    index = manifest.device.index
    where = engine + (0 if index is None else len(str(index))) + label_size(manifest.device.uuid or "")
    declarations = sum(
        SERIES_PER_DECLARATION
        * (where + label_size(d.owner) + label_size(d.name) + len(d.scope.value) + len(d.rows.value))
        + label_size(d.dtype)
        + label_size(d.capacity_source)
        + len(str(d.rows_fixed))
        + label_size(d.rows_reason)
        + label_size(d.allocation_note or "")
        for d in manifest.declarations
    )
    # The peak is exported only where every worker of the owner follows it: counting this one's is an upper bound.
    followed = manifest.observation is not None and manifest.observation.peaks_followed
    owner_series = SERIES_PER_OWNER if followed else _OWNER_SERIES_UNFOLLOWED
    per_owner = sum(owner_series * (where + label_size(owner)) for owner in owners)
    unreadable = manifest.observation.unreadable if manifest.observation else ()
    per_unreadable = _UNREADABLE_SERIES * sum(where + label_size(u.owner) + len(u.reason.value) for u in unreadable)
    cuda = _cuda_cost(manifest, engine, where)
    limit = _limit_cost(manifest, where)
    per_engine = _ENGINE_SERIES * engine + _STATE_BYTES + cuda.label_bytes + limit.label_bytes
    series = (
        SERIES_PER_DECLARATION * len(manifest.declarations)
        + owner_series * len(owners)
        + len(unreadable) * _UNREADABLE_SERIES
        + _ENGINE_SERIES
        + cuda.series
        + limit.series
    )
    return Cost(series, declarations + per_owner + per_unreadable + per_engine)


def _cuda_cost(manifest: Manifest, engine: int, where: int) -> Cost:
    """The allocator's series the manifest adds: its figures by engine and GPU, or one saying why there are none."""
    observation = manifest.observation
    cuda = None if observation is None else observation.cuda
    if cuda is None:
        reason = cuda_unavailable_reason(manifest)
        if reason is None:
            return Cost(0, 0)
        return Cost(_REASON_SERIES, _REASON_SERIES * (engine + len(reason)))
    series = _CUDA_SERIES
    if manifest.schema_version >= CUDA_DETAILS_SINCE:
        series += _CUDA_DETAIL_SERIES + (_CUDA_WARM_SERIES if cuda.warm is not None else 0)
    return Cost(series, series * where)


def _limit_cost(manifest: Manifest, where: int) -> Cost:
    """The allocator cap's series (cap and headroom, or why there is none) and the engine budget's, by engine and
    GPU; counted as if the observation were fresh (they are exported only then): an upper bound."""
    observation, budget = manifest.observation, manifest.engine_memory
    fields = () if budget is None else (getattr(budget, f.name) for f in dataclasses.fields(budget))
    budget_series = sum(value is not None for value in fields)
    cost = Cost(budget_series, budget_series * where)
    if observation is None:
        return cost
    reason = absent_reason(manifest)
    if reason is None:
        return Cost(cost.series + _CAPPED_SERIES, cost.label_bytes + _CAPPED_SERIES * where)
    return Cost(cost.series + _ABSENT_CAP_SERIES, cost.label_bytes + _ABSENT_CAP_SERIES * (where + len(reason)))


def page_engine_cost(key: EngineKey) -> Cost:
    return Cost(SERIES_PER_PAGE_ENGINE, SERIES_PER_PAGE_ENGINE * _engine_size(key, PodInfo()))


@dataclass(frozen=True)
class Limited:
    """What goes on the page under the cap, and what is left out."""

    kept: list[ManifestEntry]  # live manifests
    dropped: list[ManifestEntry]
    page_engines: frozenset[EngineKey]  # engines only a page shows, kept
    page_engines_dropped: int


class _Budget:
    def __init__(self, cap: SeriesCap) -> None:
        self.cap = cap
        self.series = 0
        self.label_bytes = 0

    def take(self, cost: Cost) -> bool:
        series, label_bytes = self.series + cost.series, self.label_bytes + cost.label_bytes
        if (self.cap.max_series is not None and series > self.cap.max_series) or (
            self.cap.max_label_bytes is not None and label_bytes > self.cap.max_label_bytes
        ):
            return False
        self.series, self.label_bytes = series, label_bytes
        return True


def _fitting(budget: _Budget, costs: Iterable[Cost]) -> list[bool]:
    """Whether the budget takes each of `costs`, in order: one that does not fit is skipped, not a stop."""
    return [budget.take(cost) for cost in costs]


def limit_series(entries: Sequence[ManifestEntry], page_keys: Collection[EngineKey], cap: SeriesCap) -> Limited:
    """The live manifests, then the engines among `page_keys` that no live manifest declares, under `cap`."""
    budget = _Budget(cap)
    live = sorted((e for e in entries if e.live and e.manifest is not None), key=lambda e: e.path)
    fits = _fitting(budget, (manifest_cost(e.manifest) for e in live if e.manifest))
    kept = [e for e, fit in zip(live, fits, strict=True) if fit]
    dropped = [e for e, fit in zip(live, fits, strict=True) if not fit]
    # An engine whose manifests were left out is left out with them, not shown as one that declares nothing.
    declared = {engine_key(e.manifest) for e in live if e.manifest}
    only_paged = sorted(set(page_keys) - declared)
    shown = _fitting(budget, map(page_engine_cost, only_paged))
    kept_paged = frozenset(key for key, fit in zip(only_paged, shown, strict=True) if fit)
    return Limited(kept, dropped, kept_paged, len(only_paged) - len(kept_paged))
