"""Every metric family kv-exporter exports, in one table (as dcgm-exporter's counters file): name, type, unit, labels,
help, and the rule saying which entity a series exists per (`metric_spec`). The family builders take their name, help
and labels from here (resolved at import: nothing is looked up per scrape); the series budget counts from here
(`budget`); the reference in docs/metrics.md is generated from here (`metrics_docs`). Adding a metric: one row below,
plus its computation. The rows' order is the page's.
"""

from __future__ import annotations

from kv_exporter.sidecar.labels import (
    DECLARATION_LABELS,
    ENGINE_GPU_LABELS,
    ENGINE_LABELS,
    GPU_LABELS,
    INFO_EXTRA_LABELS,
    OWNER_LABELS,
)
from kv_exporter.sidecar.limits import BINDINGS
from kv_exporter.sidecar.metric_spec import MetricSpec, Per, Type, When
from kv_exporter.sidecar.observed import ObservedState
from kv_exporter.sidecar.running import RunningState

G, C = Type.GAUGE, Type.COUNTER  # the rows' types, short
_OBSERVED_STATES = tuple(state.value for state in ObservedState)
_RUNNING_STATES = tuple(state.value for state in RunningState)

# -- per declaration (families.py) ---------------------------------------------------------------------------------
BYTES_PER_ROW = MetricSpec(
    "model_local_kv_bytes_per_row", G, "bytes", Per.DECLARATION, DECLARATION_LABELS, "Bytes in one row."
)
CEILING = MetricSpec(
    "model_local_kv_ceiling_bytes", G, "bytes", Per.DECLARATION, DECLARATION_LABELS,
    "Bytes at the engine's max_num_seqs rows (rows_fixed for driver=fixed).",
)  # fmt: skip
ESTIMATED = MetricSpec(
    "model_local_kv_estimated_bytes", G, "bytes", Per.DECLARATION, DECLARATION_LABELS,
    "Bytes at the sequences the engine runs now (its workers' latest step, else its page), capped at "
    "max_num_seqs (rows_fixed for driver=fixed; 0 rows for driver=max_num_seqs while that is unknown).",
)  # fmt: skip
ESTIMATED_PEAK = MetricSpec(
    "model_local_kv_estimated_peak_bytes", G, "bytes", Per.DECLARATION, DECLARATION_LABELS,
    "Bytes at the most sequences any step of the engine's workers ran over the last --running-window "
    "seconds, capped at max_num_seqs (rows_fixed for driver=fixed); absent where no worker keeps a step "
    "record.",
    When.STEP_RECORD,
)  # fmt: skip
CAPACITY_POSITIONS = MetricSpec(
    "model_local_kv_capacity_positions", G, "positions", Per.DECLARATION, DECLARATION_LABELS,
    "Positions one row can physically hold.",
)  # fmt: skip
DECLARATION_INFO = MetricSpec(
    "model_local_kv_declaration_info", Type.INFO, "", Per.DECLARATION, DECLARATION_LABELS + INFO_EXTRA_LABELS,
    "Declaration metadata (value 1).",
)  # fmt: skip

# -- per engine (families.py, running_families.py) ------------------------------------------------------------------
RUNNING = MetricSpec(
    "model_local_kv_running_sequences", G, "sequences", Per.ENGINE, ENGINE_LABELS,
    "Sequences the engine runs now: its workers' latest step (a step that ended over a second ago: 0), or, for "
    "workers that keep no step record, its metrics page's running count at the scrape.",
)  # fmt: skip
RUNNING_MAX = MetricSpec(
    "model_local_kv_running_sequences_max", G, "sequences", Per.ENGINE, ENGINE_LABELS,
    "The most sequences any step of the engine's workers ran over the last --running-window seconds.",
    When.STEP_RECORD,
)  # fmt: skip
MAX_NUM_SEQS = MetricSpec(
    "model_local_kv_max_num_seqs", G, "sequences", Per.ENGINE, ENGINE_LABELS, "max_num_seqs from its manifests.",
    When.MANIFEST,
)  # fmt: skip
ENGINE_UP = MetricSpec(
    "model_local_kv_engine_up", G, "boolean", Per.ENGINE, ENGINE_LABELS,
    "1 if its running count was read this scrape.",
)  # fmt: skip
ENGINE_MANIFESTS = MetricSpec(
    "model_local_kv_engine_manifests", G, "manifests", Per.ENGINE, ENGINE_LABELS,
    "Live valid manifests matched to this engine (0: the engine runs but declares nothing here).",
)  # fmt: skip
RUNNING_STATE = MetricSpec(
    "model_local_kv_running_state", G, "boolean", Per.ENGINE_STATE, (*ENGINE_LABELS, "state"),
    "1 for the state of the engine's step records (the worst of its workers'), 0 for the others: stepping, idle, "
    "stalled (one step has run for a minute), unreadable (a step's count unknown), torn (a write never ended: "
    "its writer died or hangs in it), invalid, absent (no record: the page's running count, if any).",
    When.MANIFEST, _RUNNING_STATES,
)  # fmt: skip
PAGE_DIFFERENCE = MetricSpec(
    "model_local_kv_running_sequences_page_difference", G, "sequences", Per.ENGINE, ENGINE_LABELS,
    "The engine page's running count at the scrape less the workers' latest step: a cross-check, never used in "
    "an estimate (only where both are known).",
    When.STEP_RECORD,
)  # fmt: skip
ENGINE_PAGE_UP = MetricSpec(
    "model_local_kv_engine_page_up", G, "boolean", Per.TARGET, ("target",), "1 if the page was fetched and read."
)

# -- per GPU: NVML and the projection (memory_families.py) ---------------------------------------------------------
GPU_TOTAL = MetricSpec(
    "model_local_kv_gpu_memory_total_bytes", G, "bytes", Per.GPU, GPU_LABELS, "GPU memory total (NVML).",
    When.PROJECTED,
)  # fmt: skip
GPU_USED = MetricSpec(
    "model_local_kv_gpu_memory_used_bytes", G, "bytes", Per.GPU, GPU_LABELS,
    "GPU memory used (NVML): without the reserved memory where NVML reports that apart, as DCGM's FB_USED.",
    When.PROJECTED,
)  # fmt: skip
GPU_RESERVED = MetricSpec(
    "model_local_kv_gpu_memory_reserved_bytes", G, "bytes", Per.GPU, GPU_LABELS,
    "GPU memory the driver and firmware reserve (NVML's version 2 memory call, as DCGM's FB_RESERVED); absent "
    "where NVML reports it only inside used.",
    When.PROJECTED,
)  # fmt: skip
GPU_FREE = MetricSpec(
    "model_local_kv_gpu_memory_free_bytes", G, "bytes", Per.GPU, GPU_LABELS, "GPU memory free (NVML).",
    When.PROJECTED,
)  # fmt: skip
GPU_PROCESS = MetricSpec(
    "model_local_kv_gpu_process_memory_bytes", G, "bytes", Per.GPU_PROCESS, (*GPU_LABELS, "pid"),
    "GPU memory NVML reports for a manifest's process (only where the pids are comparable).",
    When.PROJECTED,
)  # fmt: skip
GPU_PROJECTED_PEAK = MetricSpec(
    "model_local_kv_gpu_projected_peak_bytes", G, "bytes", Per.GPU, GPU_LABELS,
    "NVML's occupied memory (total - free: used and reserved) + sum over this GPU's live declarations of "
    "(ceiling - estimate) - the declared memory already resident + the unexplained growth.",
    When.PROJECTED,
)  # fmt: skip
GPU_UNEXPLAINED_GROWTH = MetricSpec(
    "model_local_kv_gpu_unexplained_growth_bytes", G, "bytes", Per.GPU, GPU_LABELS,
    "The part of the projected peak that observation adds: bytes no declaration explains, per running "
    "sequence, times the sequences still to come (0 while every owner holds at most what it declares).",
    When.PROJECTED,
)  # fmt: skip
GPU_RESIDENT = MetricSpec(
    "model_local_kv_gpu_resident_bytes", G, "bytes", Per.GPU, GPU_LABELS,
    "Declared memory the GPU's owners already hold beyond their running estimates (observed at the sample, "
    "at most each owner's ceiling - estimate): in NVML's used already, so the projected peak does not add it "
    "again.",
    When.PROJECTED,
)  # fmt: skip
GPU_HEADROOM = MetricSpec(
    "model_local_kv_gpu_headroom_bytes", G, "bytes", Per.GPU, GPU_LABELS,
    "What the projected peak leaves before the limit it meets first: the device's total, or a worker's allocator "
    "cap (model_local_kv_worker_headroom_bytes); negative: it would not fit.",
    When.PROJECTED,
)  # fmt: skip
GPU_SAFE_MAX_NUM_SEQS = MetricSpec(
    "model_local_kv_gpu_safe_max_num_seqs", G, "sequences", Per.GPU, GPU_LABELS,
    "Largest max_num_seqs M (the same for every engine on this GPU) with NVML used + sum over its "
    "live max_num_seqs-driven declarations of bytes_per_row * max(0, M - rows held) <= total, rows held being "
    "the estimated rows and those an owner already holds beyond them, and for each worker whose allocator is capped, "
    "reserved + its own such growth <= its cap. Assumes NVML used already holds the held and fixed rows and nothing "
    "else on the GPU grows.",
    When.PROJECTED,
)  # fmt: skip

# -- per owner and engine: observation (families.py) ----------------------------------------------------------------
OBSERVED_BYTES = MetricSpec(
    "model_local_kv_observed_bytes", G, "bytes", Per.OWNER, OWNER_LABELS,
    "Storage the owner's live model-local KV holds at the engine's last observation (transformers caches, KV in a "
    "declaring owner's own state, known cache classes' buffers), each storage counted "
    "once, summed over the engine's workers on this GPU (0: a declaring owner holding nothing).",
)  # fmt: skip
OBSERVED_PEAK = MetricSpec(
    "model_local_kv_observed_peak_bytes", G, "bytes", Per.OWNER, OWNER_LABELS,
    "The most the owner's live model-local KV held at any instant between the engine's last two "
    "observations (caches a step makes and frees included), each storage counted once, summed over its workers; "
    "absent where a worker does not follow it (KV_EXPORTER_OBSERVE_PEAK=0).",
    When.PEAK_FOLLOWED,
)  # fmt: skip
OBSERVED_CACHES = MetricSpec(
    "model_local_kv_observed_caches", G, "caches", Per.OWNER, OWNER_LABELS, "Live cache objects the owner holds."
)
UNEXPLAINED = MetricSpec(
    "model_local_kv_unexplained_bytes", G, "bytes", Per.OWNER, OWNER_LABELS,
    "max(0, observed peak - the owner's declared ceiling at max_num_seqs), the observed figure at the sample "
    "where the peak is not followed; all of it for an owner declaring nothing.",
)  # fmt: skip
UNREADABLE_CACHES = MetricSpec(
    "model_local_kv_observed_unreadable_caches", G, "caches", Per.OWNER_REASON, (*OWNER_LABELS, "reason"),
    "Live caches of the owner its workers could not read, by reason (no_layers, layers_raised, not_a_tensor, "
    "no_storage, not_followed): left out of its observed figures.",
)  # fmt: skip
OBSERVATION_STATE = MetricSpec(
    "model_local_kv_observation_state", G, "boolean", Per.ENGINE_STATE, (*ENGINE_LABELS, "state"),
    "1 for the state of the engine's observation (the worst of its workers'), 0 for the others: ok, off, "
    "unavailable, failing, stale (the sampler stopped), absent (the manifest has none), rejected (unreadable, or "
    "dated ahead of the sidecar's clock).",
    When.MANIFEST, _OBSERVED_STATES,
)  # fmt: skip
OBSERVATION_AGE = MetricSpec(
    "model_local_kv_observation_age_seconds", G, "seconds", Per.ENGINE, ENGINE_LABELS,
    "Seconds since the oldest usable sample of the engine's workers.",
    When.OBSERVED,
)  # fmt: skip

# -- per engine and GPU: torch's allocator (families.py) ------------------------------------------------------------
CUDA_ALLOCATED = MetricSpec(
    "model_local_kv_observed_cuda_allocated_bytes", G, "bytes", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "torch.cuda.memory_allocated() of the engine's workers on this GPU, at their last observation.",
    When.CUDA,
)  # fmt: skip
CUDA_RESERVED = MetricSpec(
    "model_local_kv_observed_cuda_reserved_bytes", G, "bytes", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "torch.cuda.memory_reserved() of the engine's workers on this GPU, at their last observation.",
    When.CUDA,
)  # fmt: skip
CUDA_PEAK = MetricSpec(
    "model_local_kv_observed_cuda_peak_bytes", G, "bytes", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "The most torch's allocator held on this GPU since its peak was last reset (by vLLM's profiler at start-up; "
    "kv-exporter never resets it), summed over the engine's workers.",
    When.CUDA_DETAILED,
)  # fmt: skip
CUDA_HIGH_WATER = MetricSpec(
    "model_local_kv_observed_cuda_high_water_bytes", G, "bytes", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "At most the most torch's allocator held between the engine's last two observations: its peak where that "
    "rose in between (exact), else bounded by the peak and by what was allocated in between.",
    When.CUDA_DETAILED,
)  # fmt: skip
CUDA_HIGH_WATER_FLOOR = MetricSpec(
    "model_local_kv_observed_cuda_high_water_floor_bytes", G, "bytes", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "At least the most torch's allocator held between the engine's last two observations (the larger of the two "
    "samples' allocated, or the risen peak); equal to the high-water figure where that is exact.",
    When.CUDA_DETAILED,
)  # fmt: skip
CUDA_WARM_ALLOCATED = MetricSpec(
    "model_local_kv_observed_cuda_warm_allocated_bytes", G, "bytes", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "torch.cuda.memory_allocated() when the engine's warm-up ended (its KV budget sized, its graphs captured).",
    When.CUDA_WARM,
)  # fmt: skip
CUDA_UNEXPLAINED_GROWTH = MetricSpec(
    "model_local_kv_observed_cuda_unexplained_growth_bytes", G, "bytes", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "Allocated now minus at the end of warm-up, less what the observed model-local KV grew by in that time: "
    "memory no declaration and no observed cache explains (negative where less is held than after warm-up).",
    When.CUDA_WARM,
)  # fmt: skip
CUDA_ALLOC_RETRIES = MetricSpec(
    "model_local_kv_observed_cuda_alloc_retries", C, "allocations", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "Allocations torch's allocator retried after freeing its cache (num_alloc_retries): memory pressure.",
    When.CUDA_DETAILED,
)  # fmt: skip
CUDA_OOMS = MetricSpec(
    "model_local_kv_observed_cuda_ooms", C, "allocations", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "Allocations torch's allocator failed for good: out-of-memory errors raised in the worker (num_ooms).",
    When.CUDA_DETAILED,
)  # fmt: skip
CUDA_UNAVAILABLE = MetricSpec(
    "model_local_kv_observed_cuda_unavailable", G, "workers", Per.ENGINE_REASON, (*ENGINE_LABELS, "reason"),
    "Workers of the engine whose observation has no allocator figures, by reason: not_cuda (a CPU worker), "
    "not_initialised, not_attached (model not loaded yet), no_index, stats_failed, refused (figures torch's "
    "allocator could never give together, counted in model_local_kv_observation_errors_total).",
)  # fmt: skip

# -- per worker and GPU: the limits (memory_families.py) ------------------------------------------------------------
WORKER_LIMIT = MetricSpec(
    "model_local_kv_worker_allocator_limit_bytes", G, "bytes", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "The per-process cap of torch's allocator in the engine's workers on this GPU (get_per_process_memory_fraction "
    "x the device's total; vLLM 0.34's extensible KV cache sets it), summed: reserving past it fails, whatever "
    "NVML shows free. Absent where a worker has none (model_local_kv_worker_allocator_limit_absent).",
    When.CAPPED,
)  # fmt: skip
WORKER_HEADROOM = MetricSpec(
    "model_local_kv_worker_headroom_bytes", G, "bytes", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "The cap - the workers' reserved bytes - what their own model-local memory can still grow (their declarations' "
    "ceiling - estimate, less what their owners hold beyond it, plus the unexplained growth); negative: a "
    "model-local allocation will fail at max_num_seqs.",
    When.CAPPED,
)  # fmt: skip
WORKER_LIMIT_ABSENT = MetricSpec(
    "model_local_kv_worker_allocator_limit_absent", G, "workers", Per.ENGINE_GPU_REASON,
    (*ENGINE_GPU_LABELS, "reason"),
    "Workers of the engine whose allocator has no per-process cap, by reason: no_cap (none set: only the device "
    "limits it), unsupported (a torch without the call), read_failed, not_reported (a worker of schema 4 or "
    "older), or why it has no allocator figures at all (not_cuda, not_initialised, not_attached, no_index, "
    "stats_failed).",
)  # fmt: skip
GPU_LIMIT = MetricSpec(
    "model_local_kv_gpu_limit_bytes", G, "bytes", Per.GPU, GPU_LABELS,
    "The GPU's occupancy (NVML's terms) at which the first limit is met: its total, or sooner where a worker's "
    "allocator cap binds; projected peak + headroom.",
    When.PROJECTED,
)  # fmt: skip
GPU_LIMIT_BINDING = MetricSpec(
    "model_local_kv_gpu_limit_binding", G, "boolean", Per.GPU_LIMIT, (*GPU_LABELS, "limit"),
    "1 for the limit the projected peak meets first (device: the GPU's memory; worker: a worker's allocator cap), "
    "0 for the other.",
    When.PROJECTED, BINDINGS,
)  # fmt: skip
GPU_DECLARED_CEILING = MetricSpec(
    "model_local_kv_gpu_declared_ceiling_bytes", G, "bytes", Per.GPU, GPU_LABELS,
    "The ceilings of the live declarations on this GPU, summed: what the headroom warning's margin is a fraction "
    "of (docs/alerts.md, Thresholds).",
    When.PROJECTED,
)  # fmt: skip
GPU_OTHER_PROCESSES = MetricSpec(
    "model_local_kv_gpu_other_processes", G, "processes", Per.GPU, GPU_LABELS,
    "Compute processes on this GPU that no manifest this exporter reads accounts for (by pid where NVML's pids "
    "are comparable, else by count). Above 0 the GPU's memory and projection are not exported here: processes "
    "of several pods on one GPU are the node-wide exporter's (DaemonSet layout, docs/deploy.md).",
)  # fmt: skip
ENGINE_KV_CACHE_BYTES = MetricSpec(
    "model_local_kv_engine_kv_cache_bytes", G, "bytes", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "The engine's own paged KV cache on this GPU, as its workers read it (an extensible cache's committed pages), "
    "summed over them: the memory vLLM budgets for itself, beside the model-local figures.",
    When.BUDGET,
)  # fmt: skip
ENGINE_KV_CACHE_BLOCKS = MetricSpec(
    "model_local_kv_engine_kv_cache_blocks", G, "blocks", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "The engine's KV cache blocks.", When.BUDGET,
)  # fmt: skip
ENGINE_GPU_MEMORY_UTILIZATION = MetricSpec(
    "model_local_kv_engine_gpu_memory_utilization", G, "ratio", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "The fraction of the GPU the engine budgets for itself, as resolved (vLLM 0.34: 1.0 with the extensible KV "
    "cache, else 0.92, unless set).",
    When.BUDGET,
)  # fmt: skip
ENGINE_EXTENSIBLE_KV_CACHE = MetricSpec(
    "model_local_kv_engine_extensible_kv_cache", G, "boolean", Per.ENGINE_GPU, ENGINE_GPU_LABELS,
    "1 where the engine sizes its KV cache after warm-up and caps its workers' allocators (vLLM 0.34's extensible "
    "KV cache), 0 where it does not; absent where the engine has no such mode.",
    When.BUDGET,
)  # fmt: skip

# -- the exporter itself (families.py, web/reload.py) ---------------------------------------------------------------
NVML_UP = MetricSpec(
    "model_local_kv_nvml_up", G, "boolean", Per.ONCE, (),
    "1 if the GPU reader (NVML or simulated) answered this scrape.",
)  # fmt: skip
MANIFESTS = MetricSpec("model_local_kv_manifests", G, "manifests", Per.STATE, ("state",), "Manifest files by state.")
MANIFEST_FOLDER_STATE = MetricSpec(
    "model_local_kv_manifest_folder_state", G, "boolean", Per.STATE, ("state",),
    "1 for what listing the manifest folder (--manifest-dir) found this scrape, 0 for the others: ok, missing, "
    "unreadable (permissions, I/O), not_a_folder.",
)  # fmt: skip
MANIFEST_ERRORS = MetricSpec(
    "model_local_kv_manifest_errors", C, "file versions", Per.REASON, ("reason",),
    "Invalid manifest file versions seen, by reason.",
)  # fmt: skip
ENGINE_PAGE_ERRORS = MetricSpec(
    "model_local_kv_engine_page_errors", C, "reads", Per.TARGET_REASON, ("target", "reason"),
    "Failed engine page reads, by target and reason.",
)  # fmt: skip
NVML_ERRORS = MetricSpec(
    "model_local_kv_nvml_errors", C, "calls", Per.REASON, ("reason",), "Failed GPU reader calls, by reason."
)
OBSERVATION_ERRORS = MetricSpec(
    "model_local_kv_observation_errors", C, "observations", Per.REASON, ("reason",),
    "Observations (or their allocator figures alone) refused and never exported as figures, by reason: "
    "unreadable ones once per file version, stale ones once per sample, ones from a dead process once per file "
    "version.",
)  # fmt: skip
DROPPED_MANIFESTS = MetricSpec(
    "model_local_kv_series_limit_dropped_manifests", G, "manifests", Per.ONCE, (),
    "Live manifests left out of this page because their series would exceed --max-series or "
    "--max-label-bytes (each left out alone, in file-name order).",
)  # fmt: skip
DROPPED_ENGINES = MetricSpec(
    "model_local_kv_series_limit_dropped_engines", G, "engines", Per.ONCE, (),
    "Engines that only an engine page shows (no live manifest declares them) left out of this page because "
    "their series would exceed --max-series or --max-label-bytes.",
)  # fmt: skip
SCRAPE_DURATION = MetricSpec(
    "model_local_kv_scrape_duration_seconds", G, "seconds", Per.ONCE, (), "Seconds the collection took."
)
BUILD_INFO = MetricSpec(
    "model_local_kv_exporter_build_info", Type.INFO, "", Per.ONCE, ("version", "revision", "pythonversion"),
    "kv-exporter's version, source revision and Python version (value 1).",
)  # fmt: skip
WEB_CONFIG_RELOAD = MetricSpec(
    "model_local_kv_web_config_last_reload_successful", G, "boolean", Per.ONCE, (),
    "1 if the web config in force is the file as it is now; 0 while a broken edit is refused and the "
    "last good config serves.",
    When.WEB_CONFIG,
)  # fmt: skip

# Every row above, in the order written (the page's).
TABLE: tuple[MetricSpec, ...] = tuple(row for row in tuple(globals().values()) if isinstance(row, MetricSpec))


def rows(per: Per, *when: When) -> tuple[MetricSpec, ...]:
    """The families with a series per `per`, in any of the cases `when` (all cases if none is given)."""
    return tuple(row for row in TABLE if row.per is per and (not when or row.when in when))


def series(per: Per, *when: When) -> int:
    """How many series one such entity has at most: one per family, or one per value of its last label."""
    return sum(len(row.values) or 1 for row in rows(per, *when))
