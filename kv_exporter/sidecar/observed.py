"""The observed half of a snapshot: what each owner's live caches hold, beside what it declared (pure, no I/O).

Per engine, the state of its workers' observations (never a silent absence). Per owner of a live engine on a GPU:
the bytes and cache objects its workers' samples report, summed over those workers, the ceiling its declarations
give at max_num_seqs, and the bytes no declaration explains. A declaring owner that holds nothing is there at 0; an
owner that holds caches without declaring anything is there with all its bytes unexplained.

Two figures per owner: what its caches held at the sample, and the most they held at any instant since the sample
before (the peak). The unexplained bytes are the peak's: memory a step makes and frees between two samples is still
memory the GPU must have.

Only a fresh sample counts: a worker's figures are used while its state is `ok`, and never once the sample is older
than `STALE_AFTER_INTERVALS` intervals (plus a grace for the sample-to-scrape phase): a sampler that stopped cannot
keep reporting what it last saw. Nor is a sample dated more than `FUTURE_SKEW_S` ahead of the sidecar's clock (the
two share a node's clock; a later date is a broken clock or a forged file): it would stay "fresh" for ever.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from kv_exporter.manifest import Manifest, PodInfo
from kv_exporter.observation import CUDA_DETAILS_SINCE, CudaMemory, ObservationState
from kv_exporter.sidecar.engine_page import EngineKey
from kv_exporter.sidecar.records import (
    GpuResult,
    ManifestEntry,
    Placement,
    capped_running,
    engine_key,
    first_rank,
    placement,
)

STALE_AFTER_INTERVALS = 3
STALE_GRACE_S = 10.0
FUTURE_SKEW_S = 5.0
FUTURE_TIMESTAMP = "future_timestamp"  # the refusal's reason


class ObservedState(str, Enum):
    """A worker's observation as the sidecar sees it: the worker's own state, or why there is none to use."""

    OK = "ok"
    OFF = "off"
    UNAVAILABLE = "unavailable"
    FAILING = "failing"
    STALE = "stale"  # the last sample is too old: the sampler stopped
    ABSENT = "absent"  # the manifest has no observation (schema version 1, or a writer that does not observe)
    REJECTED = "rejected"  # the manifest's observation could not be read or is dated ahead (counted by reason)


# An engine with several workers shows the worst of their states.
_WORST_FIRST = (
    ObservedState.REJECTED,
    ObservedState.FAILING,
    ObservedState.STALE,
    ObservedState.UNAVAILABLE,
    ObservedState.ABSENT,
    ObservedState.OFF,
    ObservedState.OK,
)


def worker_state(manifest: Manifest, now: float) -> ObservedState:
    if manifest.observation_problem is not None:
        return ObservedState.REJECTED
    observation = manifest.observation
    if observation is None:
        return ObservedState.ABSENT
    if observation.state is not ObservationState.OK:
        return ObservedState(observation.state.value)
    if observation.taken_at > now + FUTURE_SKEW_S:  # its figures would pass for fresh for ever
        return ObservedState.REJECTED
    if now - observation.taken_at > STALE_AFTER_INTERVALS * observation.interval_s + STALE_GRACE_S:
        return ObservedState.STALE
    return ObservedState.OK


@dataclass(frozen=True)
class OwnerView:
    """One owner of one engine on one GPU: observed beside declared."""

    key: EngineKey
    placement: Placement
    pod: PodInfo
    owner: str
    observed_bytes: int  # at the sample
    caches: int
    peak_bytes: int  # the most since the sample before (>= observed_bytes); the sample's figure where not followed
    peak_followed: bool  # every worker followed the high-water mark between samples (KV_EXPORTER_OBSERVE_PEAK)
    ceiling_bytes: int  # its declarations' ceiling at max_num_seqs, over the same workers; 0 if it declares none
    estimate_bytes: int  # its declarations at the running count (0 rows where unreadable), as the projection takes
    declares: bool
    running: int | None  # the engine's running count, capped at max_num_seqs (None: unreadable)
    max_num_seqs: int

    @property
    def unexplained_bytes(self) -> int:
        return max(0, self.peak_bytes - self.ceiling_bytes)

    @property
    def resident_bytes(self) -> int:
        """Declared memory the owner already holds beyond its running estimate, at most its declarations' growth.

        NVML's used figure already holds it (what the caches hold at the sample), so the projected peak, which adds
        each declaration's ceiling - estimate to used, must not add it again: a pool allocated in full at load
        would otherwise count twice. Only the sample's figure, not the peak: memory a step made and freed may have
        gone back to the driver."""
        if not self.declares:
            return 0
        return max(0, min(self.observed_bytes, self.ceiling_bytes) - self.estimate_bytes)

    @property
    def unexplained_per_sequence(self) -> int:
        """The unexplained bytes per running sequence (rounded up); 0 when nothing runs or nothing is unexplained."""
        if not self.unexplained_bytes or not self.running:
            return 0
        return math.ceil(self.unexplained_bytes / self.running)

    @property
    def unexplained_growth_bytes(self) -> int:
        """What the unexplained bytes may still grow by, taken as scaling with running sequences up to max_num_seqs.

        A declaration known to be low cannot say how the rest grows. Scaling with the running count is the case the
        design notes' history shows (a per-request cache declared as one fixed row) and the pessimistic choice for a
        fixed allocation larger than declared, which is the right error to make for a projected peak.
        """
        if self.running is None:
            return 0
        return self.unexplained_per_sequence * max(0, self.max_num_seqs - self.running)


@dataclass(frozen=True)
class UnreadableView:
    """Caches of one owner of one engine on one GPU that its workers could not read, for one reason."""

    key: EngineKey
    placement: Placement
    pod: PodInfo
    owner: str
    reason: str
    caches: int


@dataclass(frozen=True)
class EngineObservation:
    key: EngineKey
    pod: PodInfo
    state: ObservedState
    age_s: float | None  # of its workers' oldest usable sample; None without one


@dataclass
class CudaView:
    """torch's allocator figures, summed over an engine's workers on one GPU (observation.CudaMemory)."""

    key: EngineKey
    placement: Placement
    pod: PodInfo
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_bytes: int = 0
    high_water_bytes: int = 0
    high_water_floor_bytes: int = 0
    alloc_retries: int = 0
    ooms: int = 0
    # Over the workers whose warm-up end was seen (None: none of them): allocated then, and the growth since that
    # the growth of their observed model-local KV does not explain.
    warm_allocated_bytes: int | None = None
    unexplained_growth_bytes: int | None = None
    detailed: bool = True  # every worker wrote the figures beyond allocated and reserved (schema version 4)

    def add(self, cuda: CudaMemory, observed_bytes: int, detailed: bool) -> None:
        self.detailed = self.detailed and detailed
        self.allocated_bytes += cuda.allocated_bytes
        self.reserved_bytes += cuda.reserved_bytes
        self.peak_bytes += cuda.peak_bytes
        self.high_water_bytes += cuda.high_water_bytes
        self.high_water_floor_bytes += cuda.high_water_floor_bytes
        self.alloc_retries += cuda.alloc_retries
        self.ooms += cuda.ooms
        warm = cuda.warm
        if warm is not None:
            growth = (cuda.allocated_bytes - warm.allocated_bytes) - (observed_bytes - warm.observed_bytes)
            self.warm_allocated_bytes = (self.warm_allocated_bytes or 0) + warm.allocated_bytes
            self.unexplained_growth_bytes = (self.unexplained_growth_bytes or 0) + growth


@dataclass(frozen=True)
class CudaUnavailable:
    """Workers of an engine without allocator figures, for one reason (a CPU device, CUDA not initialised, ...)."""

    key: EngineKey
    pod: PodInfo
    reason: str
    workers: int


@dataclass(frozen=True)
class Observed:
    owners: tuple[OwnerView, ...] = ()
    engines: tuple[EngineObservation, ...] = ()
    cuda: tuple[CudaView, ...] = ()
    unreadable: tuple[UnreadableView, ...] = ()
    cuda_unavailable: tuple[CudaUnavailable, ...] = ()


def observe(
    entries: Sequence[ManifestEntry], running: dict[EngineKey, tuple[int, str]], gpu: GpuResult, now: float
) -> Observed:
    """The observed views of the live manifests in `entries`."""
    live = [e.manifest for e in entries if e.live and e.manifest is not None]
    usable = [m for m in live if worker_state(m, now) is ObservedState.OK]
    return Observed(
        owners=tuple(_owner_views(usable, running, gpu)),
        engines=tuple(_engine_observations(live, now)),
        cuda=tuple(_cuda_views(usable, gpu)),
        unreadable=tuple(_unreadable_views(usable, gpu)),
        cuda_unavailable=tuple(_cuda_unavailable(usable)),
    )


_OwnerKey = tuple[EngineKey, Placement, PodInfo, str]  # engine, GPU, pod, owner


@dataclass
class _Tally:
    max_num_seqs: int
    held: int = 0
    caches: int = 0
    peak: int = 0
    peak_followed: bool = True
    ceiling: int = 0
    estimate: int = 0
    declares: bool = False


def _owner_views(
    manifests: Iterable[Manifest], running: dict[EngineKey, tuple[int, str]], gpu: GpuResult
) -> list[OwnerView]:
    tallies: dict[_OwnerKey, _Tally] = {}
    for m in manifests:
        base = (engine_key(m), placement(m, gpu), m.pod)
        sequences = capped_running(running.get(base[0]), m.max_num_seqs) or 0  # none where unreadable
        assert m.observation is not None  # usable ones have one
        followed = m.observation.peaks_followed
        for held in m.observation.owners:
            tally = tallies.setdefault((*base, held.owner), _Tally(m.max_num_seqs))
            tally.held += held.bytes
            tally.caches += held.caches
            tally.peak += held.peak_bytes  # an upper bound of the workers' joint peak: each one's is its own
            tally.peak_followed = tally.peak_followed and followed
        for d in m.declarations:
            tally = tallies.setdefault((*base, d.owner), _Tally(m.max_num_seqs))
            tally.ceiling += d.peak_bytes(m.max_num_seqs)
            tally.estimate += d.bytes_per_row * d.rows_at(sequences)
            tally.declares = True
            tally.peak_followed = tally.peak_followed and followed
    views = []
    for (key, where, pod, owner), tally in tallies.items():
        known = running.get(key)
        views.append(
            OwnerView(
                key=key,
                placement=where,
                pod=pod,
                owner=owner,
                observed_bytes=tally.held,
                caches=tally.caches,
                peak_bytes=tally.peak,
                peak_followed=tally.peak_followed,
                ceiling_bytes=tally.ceiling,
                estimate_bytes=tally.estimate,
                declares=tally.declares,
                running=capped_running(known, tally.max_num_seqs),
                max_num_seqs=tally.max_num_seqs,
            )
        )
    return sorted(views, key=lambda v: (v.key, v.placement.gpu, v.placement.uuid, v.owner))


def _engine_observations(manifests: Iterable[Manifest], now: float) -> list[EngineObservation]:
    by_engine: dict[EngineKey, list[Manifest]] = {}
    for m in manifests:
        by_engine.setdefault(engine_key(m), []).append(m)
    result = []
    for key, workers in sorted(by_engine.items()):
        states = {worker_state(m, now) for m in workers}
        taken = [m.observation.taken_at for m in workers if m.observation and worker_state(m, now) is ObservedState.OK]
        result.append(
            EngineObservation(
                key=key,
                pod=first_rank(workers).pod,
                state=next(state for state in _WORST_FIRST if state in states),
                age_s=max(0.0, now - min(taken)) if taken else None,
            )
        )
    return result


def _unreadable_views(manifests: Iterable[Manifest], gpu: GpuResult) -> list[UnreadableView]:
    counts: dict[tuple[EngineKey, Placement, PodInfo, str, str], int] = {}
    for m in manifests:
        assert m.observation is not None  # usable ones have one
        for bad in m.observation.unreadable:
            key = (engine_key(m), placement(m, gpu), m.pod, bad.owner, bad.reason.value)
            counts[key] = counts.get(key, 0) + bad.caches
    ordered = sorted(counts.items(), key=lambda item: (item[0][0], item[0][1].gpu, item[0][1].uuid, *item[0][3:]))
    return [UnreadableView(*key, caches) for key, caches in ordered]


def _cuda_views(manifests: Iterable[Manifest], gpu: GpuResult) -> list[CudaView]:
    views: dict[tuple[EngineKey, Placement, PodInfo], CudaView] = {}
    for m in manifests:
        cuda = m.observation.cuda if m.observation else None
        if cuda is None or m.observation is None:
            continue
        key = (engine_key(m), placement(m, gpu), m.pod)
        view = views.setdefault(key, CudaView(*key))
        view.add(cuda, sum(owner.bytes for owner in m.observation.owners), m.schema_version >= CUDA_DETAILS_SINCE)
    return sorted(views.values(), key=lambda v: (v.key, v.placement.gpu, v.placement.uuid))


# Why a worker's observation has no allocator figures although it wrote some: they were refused.
ALLOCATOR_REFUSED = "refused"


def cuda_unavailable_reason(manifest: Manifest) -> str | None:
    """Why the worker's usable observation has no allocator figures (None: it has them, or has no observation)."""
    observation = manifest.observation
    if observation is None or observation.cuda is not None:
        return None
    if manifest.allocator_problem is not None:
        return ALLOCATOR_REFUSED
    return None if observation.cuda_unavailable is None else observation.cuda_unavailable.value


def _cuda_unavailable(manifests: Iterable[Manifest]) -> list[CudaUnavailable]:
    counts: dict[tuple[EngineKey, PodInfo, str], int] = {}
    for m in manifests:
        reason = cuda_unavailable_reason(m)
        if reason is not None:
            key = (engine_key(m), m.pod, reason)
            counts[key] = counts.get(key, 0) + 1
    ordered = sorted(counts.items(), key=lambda item: (item[0][0], item[0][2]))
    return [CudaUnavailable(key, pod, reason, workers) for (key, pod, reason), workers in ordered]
