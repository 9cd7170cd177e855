"""Each worker's own limit beside the device's, and which one a GPU's model-local growth meets first (pure, no I/O).

A worker whose torch allocator is capped (vLLM 0.34's extensible KV cache caps it; anyone may) fails an allocation
once its reserved bytes would pass the cap, whatever NVML shows free. Its headroom is the cap less what it reserves
now less what its own model-local memory can still grow: its declarations' ceiling - estimate, less what its owners
already hold beyond the estimate, plus their unexplained growth (`sidecar.observed`). A GPU's binding limit is the
one met first: the device's (total - projected peak) or any of its workers'.

The figures are an engine's workers on one GPU in one pod, summed, as the other allocator figures are; a worker
without a cap (or without allocator figures) leaves the group without a limit and says why.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kv_exporter.manifest import Manifest, PodInfo
from kv_exporter.sidecar.engine_page import EngineKey
from kv_exporter.sidecar.observed import OwnerView
from kv_exporter.sidecar.records import GpuResult, ManifestEntry, Placement, engine_key, placement

# Why a worker has no cap, beyond the worker's own reasons (`AllocatorLimitAbsent`, `CudaUnavailable`).
NOT_REPORTED = "not_reported"  # a worker of schema version 4 or older: it had no cap to give

BINDING_DEVICE = "device"
BINDING_WORKER = "worker"
BINDINGS = (BINDING_DEVICE, BINDING_WORKER)

WorkerKey = tuple[EngineKey, Placement, PodInfo]


@dataclass(frozen=True)
class WorkerLimit:
    """An engine's capped workers on one GPU: their caps, what they reserve, and what they may still grow."""

    key: EngineKey
    placement: Placement
    pod: PodInfo
    limit_bytes: int
    reserved_bytes: int
    growth_bytes: int
    workers: int

    @property
    def group(self) -> WorkerKey:
        return (self.key, self.placement, self.pod)

    @property
    def room_bytes(self) -> int:
        """What the cap lets the workers reserve beyond what they reserve now."""
        return self.limit_bytes - self.reserved_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.room_bytes - self.growth_bytes


@dataclass(frozen=True)
class LimitAbsent:
    """An engine's workers on one GPU that have no cap, for one reason."""

    key: EngineKey
    placement: Placement
    pod: PodInfo
    reason: str
    workers: int


@dataclass(frozen=True)
class Limits:
    workers: tuple[WorkerLimit, ...] = ()
    absent: tuple[LimitAbsent, ...] = ()


def owner_growth(owner: OwnerView) -> int:
    """What an owner's memory can still grow by: the term it adds to its GPU's projected peak."""
    return owner.ceiling_bytes - owner.estimate_bytes - owner.resident_bytes + owner.unexplained_growth_bytes


def absent_reason(manifest: Manifest) -> str | None:
    """Why a worker with a usable observation has no cap (None: it has one)."""
    observation = manifest.observation
    assert observation is not None  # usable manifests have one
    cuda = observation.cuda
    if cuda is None:
        return observation.cuda_unavailable.value if observation.cuda_unavailable is not None else NOT_REPORTED
    if cuda.limit_bytes is not None:
        return None
    return cuda.limit_absent.value if cuda.limit_absent is not None else NOT_REPORTED


def worker_limits(usable: Iterable[Manifest], gpu: GpuResult, owners: Sequence[OwnerView]) -> Limits:
    """`usable`: the live manifests whose observation is fresh (`observed.worker_state` OK); `owners`: their views."""
    capped: dict[WorkerKey, list[Manifest]] = {}
    uncapped: dict[WorkerKey, dict[str, int]] = {}
    for m in usable:
        group = _group(m, gpu)
        reason = absent_reason(m)
        if reason is None:
            capped.setdefault(group, []).append(m)
        else:
            reasons = uncapped.setdefault(group, {})
            reasons[reason] = reasons.get(reason, 0) + 1
    growth: dict[WorkerKey, int] = {}
    for owner in owners:
        group = (owner.key, owner.placement, owner.pod)
        growth[group] = growth.get(group, 0) + owner_growth(owner)
    workers = [
        WorkerLimit(
            *group, _sum_cuda(ms, "limit_bytes"), _sum_cuda(ms, "reserved_bytes"), growth.get(group, 0), len(ms)
        )
        for group, ms in capped.items()
        if group not in uncapped  # a group is capped only when every worker in it is
    ]
    absent = [LimitAbsent(*group, reason, n) for group, reasons in uncapped.items() for reason, n in reasons.items()]
    return Limits(
        tuple(sorted(workers, key=lambda w: _order(w.group))),
        tuple(sorted(absent, key=lambda a: (*_order((a.key, a.placement, a.pod)), a.reason))),
    )


@dataclass
class EngineBudget:
    """What an engine's workers on one GPU read of the engine's own budget (`EngineMemory`), summed where it adds."""

    key: EngineKey
    placement: Placement
    pod: PodInfo
    kv_cache_bytes: int | None = None  # summed over the workers that read it
    kv_cache_blocks: int | None = None  # the engine's (every rank has the same)
    gpu_memory_utilization: float | None = None
    extensible_kv_cache: bool | None = None


def engine_budgets(entries: Iterable[ManifestEntry], gpu: GpuResult) -> tuple[EngineBudget, ...]:
    """One per engine, GPU and pod among the live manifests of `entries` that carry the engine's budget."""
    budgets: dict[WorkerKey, EngineBudget] = {}
    for entry in entries:
        m = entry.manifest
        if m is None or not entry.live or m.engine_memory is None:
            continue
        memory = m.engine_memory
        group = _group(m, gpu)
        budget = budgets.setdefault(group, EngineBudget(*group))
        if memory.kv_cache_bytes is not None:
            budget.kv_cache_bytes = (budget.kv_cache_bytes or 0) + memory.kv_cache_bytes
        if memory.kv_cache_blocks is not None:
            budget.kv_cache_blocks = max(budget.kv_cache_blocks or 0, memory.kv_cache_blocks)
        if memory.gpu_memory_utilization is not None:
            budget.gpu_memory_utilization = memory.gpu_memory_utilization
        if memory.extensible_kv_cache is not None:
            budget.extensible_kv_cache = bool(budget.extensible_kv_cache) or memory.extensible_kv_cache
    return tuple(sorted(budgets.values(), key=lambda b: _order((b.key, b.placement, b.pod))))


def _group(m: Manifest, gpu: GpuResult) -> WorkerKey:
    return (engine_key(m), placement(m, gpu), m.pod)


def _sum_cuda(manifests: Sequence[Manifest], name: str) -> int:
    return sum(int(getattr(m.observation.cuda, name)) for m in manifests if m.observation and m.observation.cuda)


def _order(group: WorkerKey) -> tuple[object, ...]:
    key, where, pod = group
    return (key, where.gpu, where.uuid, pod.name or "", pod.namespace or "", pod.container or "")
