"""Metric families of a GPU's memory: NVML's figures and the projected peak, the limits it meets (`sidecar.limits`):
each worker's allocator cap and headroom (or why it has none), the binding limit per GPU, the processes no manifest
accounts for, and the KV budget the engine itself sized (docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.core import Metric

from kv_exporter.manifest import PodInfo
from kv_exporter.sidecar import metrics_table as table
from kv_exporter.sidecar.engine_page import EngineKey
from kv_exporter.sidecar.labels import engine_labels, pod_labels
from kv_exporter.sidecar.limits import BINDINGS, EngineBudget, Limits
from kv_exporter.sidecar.snapshot import GpuView, Snapshot


def gpu_families(gpus: Sequence[GpuView]) -> list[Metric]:
    total = table.GPU_TOTAL.rows()
    used = table.GPU_USED.rows()
    reserved = table.GPU_RESERVED.rows()
    free = table.GPU_FREE.rows()
    process = table.GPU_PROCESS.rows()
    peak = table.GPU_PROJECTED_PEAK.rows()
    growth = table.GPU_UNEXPLAINED_GROWTH.rows()
    resident = table.GPU_RESIDENT.rows()
    headroom = table.GPU_HEADROOM.rows()
    safe = table.GPU_SAFE_MAX_NUM_SEQS.rows()
    for view in gpus:
        if not view.projected:  # another pod's processes share it: the node-wide exporter's (memory_families)
            continue
        labels = gpu_labels(view)
        total.add_metric(labels, view.memory.total)
        used.add_metric(labels, view.memory.used)
        free.add_metric(labels, view.memory.free)
        if view.memory.reserved is not None:
            reserved.add_metric(labels, view.memory.reserved)
        for pid, value in view.processes.items():
            process.add_metric((*labels, str(pid)), value)
        peak.add_metric(labels, view.projected_peak)
        growth.add_metric(labels, view.unexplained_growth)
        resident.add_metric(labels, view.resident)
        headroom.add_metric(labels, view.headroom)
        if view.safe_max_num_seqs is not None:
            safe.add_metric(labels, view.safe_max_num_seqs)
    return [total, used, reserved, free, process, peak, growth, resident, headroom, safe]


def limit_families(snapshot: Snapshot) -> list[Metric]:
    return [
        *worker_families(snapshot.limits),
        *gpu_limit_families(snapshot.gpus),
        *budget_families(snapshot.budgets),
    ]


def worker_families(limits: Limits) -> list[Metric]:
    limit = table.WORKER_LIMIT.rows()
    headroom = table.WORKER_HEADROOM.rows()
    for worker in limits.workers:
        labels = _worker_labels(worker.key, worker.placement.gpu, worker.placement.uuid, worker.pod)
        limit.add_metric(labels, worker.limit_bytes)
        headroom.add_metric(labels, worker.headroom_bytes)
    absent = table.WORKER_LIMIT_ABSENT.rows()
    for missing in limits.absent:
        labels = _worker_labels(missing.key, missing.placement.gpu, missing.placement.uuid, missing.pod)
        absent.add_metric((*labels, missing.reason), missing.workers)
    return [limit, headroom, absent]


def gpu_limit_families(gpus: Sequence[GpuView]) -> list[Metric]:
    limit = table.GPU_LIMIT.rows()
    binding = table.GPU_LIMIT_BINDING.rows()
    ceiling = table.GPU_DECLARED_CEILING.rows()
    others = table.GPU_OTHER_PROCESSES.rows()
    for view in gpus:
        labels = gpu_labels(view)
        if view.other_processes is not None:
            others.add_metric(labels, view.other_processes)
        if not view.projected:
            continue
        limit.add_metric(labels, view.limit)
        ceiling.add_metric(labels, view.declared_ceiling)
        for name in BINDINGS:
            binding.add_metric((*labels, name), int(name == view.binding))
    return [limit, binding, ceiling, others]


def budget_families(budgets: Sequence[EngineBudget]) -> list[Metric]:
    kv_bytes = table.ENGINE_KV_CACHE_BYTES.rows()
    blocks = table.ENGINE_KV_CACHE_BLOCKS.rows()
    utilization = table.ENGINE_GPU_MEMORY_UTILIZATION.rows()
    extensible = table.ENGINE_EXTENSIBLE_KV_CACHE.rows()
    for budget in budgets:
        labels = _worker_labels(budget.key, budget.placement.gpu, budget.placement.uuid, budget.pod)
        if budget.kv_cache_bytes is not None:
            kv_bytes.add_metric(labels, budget.kv_cache_bytes)
        if budget.kv_cache_blocks is not None:
            blocks.add_metric(labels, budget.kv_cache_blocks)
        if budget.gpu_memory_utilization is not None:
            utilization.add_metric(labels, budget.gpu_memory_utilization)
        if budget.extensible_kv_cache is not None:
            extensible.add_metric(labels, int(budget.extensible_kv_cache))
    return [kv_bytes, blocks, utilization, extensible]


def _worker_labels(key: EngineKey, gpu: str, uuid: str, pod: PodInfo) -> tuple[str, ...]:
    return (*engine_labels(key), gpu, uuid, *pod_labels(pod))


def gpu_labels(view: GpuView) -> tuple[str, ...]:
    return (str(view.memory.index), view.memory.uuid, view.source, *pod_labels(view.pod))
