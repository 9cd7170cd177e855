"""Metric families of a GPU's memory: NVML's figures and the projected peak, the limits it meets (`sidecar.limits`):
each worker's allocator cap and headroom (or why it has none), the binding limit per GPU, the processes no manifest
accounts for, and the KV budget the engine itself sized (docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.core import Metric

from kv_exporter.manifest import PodInfo
from kv_exporter.sidecar.engine_page import EngineKey
from kv_exporter.sidecar.exposition import GaugeRows
from kv_exporter.sidecar.labels import ENGINE_GPU_LABELS, GPU_LABELS, engine_labels, gpu_labels, pod_labels
from kv_exporter.sidecar.limits import BINDINGS, EngineBudget, Limits
from kv_exporter.sidecar.snapshot import GpuView, Snapshot

SAFE_MAX_NUM_SEQS_HELP = (
    "Largest max_num_seqs M (the same for every engine on this GPU) with NVML used + sum over its "
    "live max_num_seqs-driven declarations of bytes_per_row * max(0, M - rows held) <= total, rows held being "
    "the estimated rows and those an owner already holds beyond them, and for each worker whose allocator is capped, "
    "reserved + its own such growth <= its cap. Assumes NVML used already holds the held and fixed rows and nothing "
    "else on the GPU grows."
)


def gpu_families(gpus: Sequence[GpuView]) -> list[Metric]:
    total = GaugeRows("model_local_kv_gpu_memory_total_bytes", "GPU memory total (NVML).", GPU_LABELS)
    used = GaugeRows(
        "model_local_kv_gpu_memory_used_bytes",
        "GPU memory used (NVML): without the reserved memory where NVML reports that apart, as DCGM's FB_USED.",
        GPU_LABELS,
    )
    reserved = GaugeRows(
        "model_local_kv_gpu_memory_reserved_bytes",
        "GPU memory the driver and firmware reserve (NVML's version 2 memory call, as DCGM's FB_RESERVED); absent "
        "where NVML reports it only inside used.",
        GPU_LABELS,
    )
    free = GaugeRows("model_local_kv_gpu_memory_free_bytes", "GPU memory free (NVML).", GPU_LABELS)
    process = GaugeRows(
        "model_local_kv_gpu_process_memory_bytes",
        "GPU memory NVML reports for a manifest's process (only where the pids are comparable).",
        (*GPU_LABELS, "pid"),
    )
    peak = GaugeRows(
        "model_local_kv_gpu_projected_peak_bytes",
        "NVML's occupied memory (total - free: used and reserved) + sum over this GPU's live declarations of "
        "(ceiling - estimate) - the declared memory already resident + the unexplained growth.",
        GPU_LABELS,
    )
    growth = GaugeRows(
        "model_local_kv_gpu_unexplained_growth_bytes",
        "The part of the projected peak that observation adds: bytes no declaration explains, per running "
        "sequence, times the sequences still to come (0 while every owner holds at most what it declares).",
        GPU_LABELS,
    )
    resident = GaugeRows(
        "model_local_kv_gpu_resident_bytes",
        "Declared memory the GPU's owners already hold beyond their running estimates (observed at the sample, "
        "at most each owner's ceiling - estimate): in NVML's used already, so the projected peak does not add it "
        "again.",
        GPU_LABELS,
    )
    headroom = GaugeRows(
        "model_local_kv_gpu_headroom_bytes",
        "What the projected peak leaves before the limit it meets first: the device's total, or a worker's allocator "
        "cap (model_local_kv_worker_headroom_bytes); negative: it would not fit.",
        GPU_LABELS,
    )
    safe = GaugeRows("model_local_kv_gpu_safe_max_num_seqs", SAFE_MAX_NUM_SEQS_HELP, GPU_LABELS)
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
    limit = GaugeRows(
        "model_local_kv_worker_allocator_limit_bytes",
        "The per-process cap of torch's allocator in the engine's workers on this GPU (get_per_process_memory_fraction "
        "x the device's total; vLLM 0.34's extensible KV cache sets it), summed: reserving past it fails, whatever "
        "NVML shows free. Absent where a worker has none (model_local_kv_worker_allocator_limit_absent).",
        ENGINE_GPU_LABELS,
    )
    headroom = GaugeRows(
        "model_local_kv_worker_headroom_bytes",
        "The cap - the workers' reserved bytes - what their own model-local memory can still grow (their declarations' "
        "ceiling - estimate, less what their owners hold beyond it, plus the unexplained growth); negative: a "
        "model-local allocation will fail at max_num_seqs.",
        ENGINE_GPU_LABELS,
    )
    for worker in limits.workers:
        labels = _worker_labels(worker.key, worker.placement.gpu, worker.placement.uuid, worker.pod)
        limit.add_metric(labels, worker.limit_bytes)
        headroom.add_metric(labels, worker.headroom_bytes)
    absent = GaugeRows(
        "model_local_kv_worker_allocator_limit_absent",
        "Workers of the engine whose allocator has no per-process cap, by reason: no_cap (none set: only the device "
        "limits it), unsupported (a torch without the call), read_failed, not_reported (a worker of schema 4 or "
        "older), or why it has no allocator figures at all (not_cuda, not_initialised, not_attached, no_index, "
        "stats_failed).",
        (*ENGINE_GPU_LABELS, "reason"),
    )
    for missing in limits.absent:
        labels = _worker_labels(missing.key, missing.placement.gpu, missing.placement.uuid, missing.pod)
        absent.add_metric((*labels, missing.reason), missing.workers)
    return [limit, headroom, absent]


def gpu_limit_families(gpus: Sequence[GpuView]) -> list[Metric]:
    limit = GaugeRows(
        "model_local_kv_gpu_limit_bytes",
        "The GPU's occupancy (NVML's terms) at which the first limit is met: its total, or sooner where a worker's "
        "allocator cap binds; projected peak + headroom.",
        GPU_LABELS,
    )
    binding = GaugeRows(
        "model_local_kv_gpu_limit_binding",
        "1 for the limit the projected peak meets first (device: the GPU's memory; worker: a worker's allocator cap), "
        "0 for the other.",
        (*GPU_LABELS, "limit"),
    )
    ceiling = GaugeRows(
        "model_local_kv_gpu_declared_ceiling_bytes",
        "The ceilings of the live declarations on this GPU, summed: what the headroom warning's margin is a fraction "
        "of (docs/alerts.md, Thresholds).",
        GPU_LABELS,
    )
    others = GaugeRows(
        "model_local_kv_gpu_other_processes",
        "Compute processes on this GPU that no manifest this exporter reads accounts for (by pid where NVML's pids "
        "are comparable, else by count). Above 0 the GPU's memory and projection are not exported here: processes "
        "of several pods on one GPU are the node-wide exporter's (DaemonSet layout, docs/deploy.md).",
        GPU_LABELS,
    )
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
    kv_bytes = GaugeRows(
        "model_local_kv_engine_kv_cache_bytes",
        "The engine's own paged KV cache on this GPU, as its workers read it (an extensible cache's committed pages), "
        "summed over them: the memory vLLM budgets for itself, beside the model-local figures.",
        ENGINE_GPU_LABELS,
    )
    blocks = GaugeRows("model_local_kv_engine_kv_cache_blocks", "The engine's KV cache blocks.", ENGINE_GPU_LABELS)
    utilization = GaugeRows(
        "model_local_kv_engine_gpu_memory_utilization",
        "The fraction of the GPU the engine budgets for itself, as resolved (vLLM 0.34: 1.0 with the extensible KV "
        "cache, else 0.92, unless set).",
        ENGINE_GPU_LABELS,
    )
    extensible = GaugeRows(
        "model_local_kv_engine_extensible_kv_cache",
        "1 where the engine sizes its KV cache after warm-up and caps its workers' allocators (vLLM 0.34's extensible "
        "KV cache), 0 where it does not; absent where the engine has no such mode.",
        ENGINE_GPU_LABELS,
    )
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
