"""What a worker knows of its engine's own memory budget: vLLM's paged KV cache and how it was sized.

Part of the manifest contract (schema version 5): the hook reads it from the runner once the engine's KV cache has
its final size, the sidecar exports it beside the model-local figures, so "where did the memory go" has the engine's
half next to the model's. Every field is null where the worker cannot read it (an older vLLM, a runner without it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from kv_exporter.document import Doc, Range
from kv_exporter.observation import Bytes


@dataclass(frozen=True)
class EngineMemory:
    kv_cache_bytes: Annotated[
        Bytes | None,
        Doc(
            "bytes of the paged KV cache on this worker's device, each storage once (the committed pages of an "
            "extensible KV cache)"
        ),
    ] = None
    kv_cache_blocks: Annotated[int | None, Range(0), Doc("the engine's KV cache blocks (num_gpu_blocks)")] = None
    gpu_memory_utilization: Annotated[
        float | None,
        Range(0, 1),
        Doc("the fraction of the device the engine budgets for itself, as resolved (vLLM 0.34: 1.0 when extensible)"),
    ] = None
    extensible_kv_cache: Annotated[
        bool | None,
        Doc("vLLM 0.34's extensible KV cache (sized after warm-up, torch's allocator capped); null: no such mode"),
    ] = None
