"""What the worker can read of its engine's own memory budget (`kv_exporter.engine_memory.EngineMemory`).

Read at each publish from the runner vLLM built: the cache config (blocks, the resolved memory utilization, vLLM 0.34's
extensible mode) and the paged KV cache itself (its committed pages where it is extensible, else its tensors'
storages). Before the KV cache exists (the load phase) its fields are null. Never raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kv_exporter.engine_memory import EngineMemory
from kv_exporter.plugin.oncelog import warn_once


def engine_memory(runner: Any) -> EngineMemory | None:
    try:
        config = getattr(runner, "vllm_config", None)
        cache = getattr(runner, "cache_config", None) or getattr(config, "cache_config", None)
        return EngineMemory(
            kv_cache_bytes=kv_cache_bytes(runner),
            kv_cache_blocks=_optional_int(getattr(cache, "num_gpu_blocks", None)),
            gpu_memory_utilization=utilization(cache),
            extensible_kv_cache=_optional_bool(getattr(cache, "enable_extensible_kv_cache", None)),
        )
    except Exception as exc:
        warn_once("engine-memory", "kv-exporter: cannot read the engine's KV budget (%r); the manifest has none", exc)
        return None


def utilization(cache: Any) -> float | None:
    """vLLM 0.34 resolves an unset `gpu_memory_utilization` by its sizing mode (1.0 extensible, 0.92 otherwise);
    earlier versions keep the value itself."""
    value = getattr(cache, "resolved_gpu_memory_utilization", None)
    if value is None:
        value = getattr(cache, "gpu_memory_utilization", None)
    return None if value is None else float(value)


def kv_cache_bytes(runner: Any) -> int | None:
    """The paged KV cache's bytes on this worker's device: an extensible cache's committed pages (mapped outside
    torch's allocator), else its tensors' storages, each once; None while it has none."""
    extensible = getattr(runner, "extensible_kv_cache", None)
    if extensible is not None:
        return int(extensible.physical_bytes)
    tensors = list(_tensors(getattr(runner, "kv_caches", None)))
    if not tensors:
        return None
    from kv_exporter.cachebytes import SeenStorages, new_storage_bytes  # torch is loaded: a runner exists

    seen = SeenStorages()
    return sum(new_storage_bytes(tensor, seen) for tensor in tensors)


def _tensors(held: object) -> Iterator[Any]:
    """The tensors of a runner's `kv_caches`: a list per layer, a dict by layer name, or lists of (K, V) pairs."""
    if held is None:
        return
    if isinstance(held, dict):
        held = list(held.values())
    if isinstance(held, (list, tuple)):
        for item in held:
            yield from _tensors(item)
    elif hasattr(held, "untyped_storage"):
        yield held


def _optional_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _optional_bool(value: object) -> bool | None:
    return value if isinstance(value, bool) else None
