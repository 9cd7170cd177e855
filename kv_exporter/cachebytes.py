"""Measure what a live HuggingFace ``transformers`` cache really holds.

A declaration (``ModelLocalKVSpec``) says how many bytes a cache *should* hold. This module reads the
cache object itself, so tests and debugging sessions can check the declaration against the tensors.

Two figures, because they differ for sliding-window layers:

- ``shown_bytes``: ``numel() * element_size()`` of every K and V tensor the cache exposes. This is what a
  declaration with the positions the cache really holds must equal.
- ``allocated_bytes``: the storage behind those tensors, each storage counted once. A dynamic
  sliding-window layer keeps a *view* of its last ``window - 1`` positions, but the storage behind the view
  holds a whole window after a decode step (and every prompt position right after a prefill), so
  ``allocated_bytes`` is larger than ``shown_bytes`` there.

Both are storage sizes as torch reports them, not allocator blocks: a CUDA caching allocator rounds each
block up further, which no cache object can show.

torch is imported lazily: importing ``kv_exporter`` must never import torch (the sidecar has none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CacheBytes",
    "LayerBytes",
    "NotACache",
    "NotATensor",
    "SeenStorages",
    "StorageUnavailable",
    "measure_cache_bytes",
]

# EncoderDecoderCache has no `.layers`; it holds two ordinary caches under these names.
_SUB_CACHES = ("self_attention_cache", "cross_attention_cache")


class StorageUnavailable(TypeError):
    """A cache tensor whose storage torch will not show (a sparse or a wrapper tensor): its bytes are unknown."""


class NotACache(TypeError):
    """An object with neither ``.layers`` nor an encoder-decoder cache's two halves."""


class NotATensor(TypeError):
    """A layer whose ``keys`` or ``values`` hold something other than a tensor (or None)."""


class SeenStorages:
    """The storages counted so far: base pointers per device (views and layers sharing KV point at the same one).

    Each pointer keeps a weak reference to its storage (torch's own, to the storage itself rather than to a Python
    wrapper of it): the sampler keeps one `SeenStorages` across its pauses, and a storage freed during one and its
    address given to a new storage must not make the new one look counted. The weak references are given back in
    `clear`. Plain ints in `SHARDS` small dicts, for the sampler's sake: one growing past ~20,000 keys rehashes them
    all at once (~1.4 ms), and as many (device, pointer) tuples take ~5 ms to free.
    """

    SHARDS = 61  # a prime: pointers aligned to any power of two still spread evenly

    __slots__ = ("_by_device", "_storage_type")

    def __init__(self) -> None:
        self._by_device: dict[object, list[dict[int, int]]] = {}
        self._storage_type: Any = None  # torch.UntypedStorage (its weak-reference calls), from the first storage

    def add(self, device: object, storage: Any) -> bool:
        """True when this storage was not seen yet (it is now)."""
        shards = self._by_device.get(device)
        if shards is None:
            shards = self._by_device[device] = [{} for _ in range(self.SHARDS)]
        pointer: int = storage.data_ptr()
        shard = shards[pointer % self.SHARDS]
        if self._storage_type is None:
            self._storage_type = type(storage)
        known = shard.get(pointer)
        if known is not None:
            if not self._storage_type._expired(known):
                return False
            self._storage_type._free_weak_ref(known)  # that storage is gone: this is another one at its address
        shard[pointer] = storage._weak_ref()
        return True

    def clear(self, between: Callable[[], None]) -> None:
        """Forget every storage, one shard at a time, calling `between` after each."""
        free = None if self._storage_type is None else self._storage_type._free_weak_ref
        for shards in self._by_device.values():
            for shard in shards:
                if free is not None:
                    for weak in shard.values():
                        free(weak)
                shard.clear()
                between()
        self._by_device.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # torch already torn down at exit: nothing left to give back to
            self.clear(lambda: None)


@dataclass(frozen=True)
class LayerBytes:
    """One cache layer's K and V."""

    path: str
    """Where the layer sits, e.g. ``layers[0]`` or ``cross_attention_cache.layers[2]``."""
    kind: str
    """The layer's class name, e.g. ``DynamicSlidingWindowLayer`` or ``StaticLayer``."""
    positions: int
    """Positions the key tensor shows (its second-to-last dimension); 0 when not allocated."""
    shown_bytes: int
    allocated_bytes: int
    """Storage first seen at this layer; storage shared with an earlier layer is not counted again."""

    @property
    def allocated(self) -> bool:
        """Whether the layer holds any K/V bytes (a static layer allocates at its first update)."""
        return self.positions > 0 or self.allocated_bytes > 0


@dataclass(frozen=True)
class CacheBytes:
    """What a cache object holds, summed over all its layers."""

    shown_bytes: int
    allocated_bytes: int
    layers: int
    """Layer objects walked (for an EncoderDecoderCache: self-attention plus cross-attention layers)."""
    allocated_layers: int
    per_layer: tuple[LayerBytes, ...] = ()

    @property
    def unshown_bytes(self) -> int:
        """Storage the tensors do not show: the sliding-window gap, 0 for full and static layers."""
        return self.allocated_bytes - self.shown_bytes


def measure_cache_bytes(cache: object) -> CacheBytes:
    """Bytes a ``transformers`` cache shows and allocates, storage deduplicated across the whole cache.

    Accepts any cache with ``.layers`` (DynamicCache, StaticCache, ...) and EncoderDecoderCache. A layer
    whose ``keys`` is still ``None`` (a StaticCache layer before its first update, a KV-sharing dummy layer)
    counts 0. Raises ``TypeError`` for an object that is not a transformers cache, ``StorageUnavailable`` for
    a tensor without an accessible storage.
    """
    import torch  # lazily: kv_exporter must stay importable without torch

    seen = SeenStorages()
    per_layer = tuple(
        _measure_layer(f"{prefix}layers[{index}]", layer, torch.Tensor, seen)
        for prefix, layers in _walk(cache, "")
        for index, layer in enumerate(layers)
    )
    return CacheBytes(
        shown_bytes=sum(layer.shown_bytes for layer in per_layer),
        allocated_bytes=sum(layer.allocated_bytes for layer in per_layer),
        layers=len(per_layer),
        allocated_layers=sum(1 for layer in per_layer if layer.allocated),
        per_layer=per_layer,
    )


def _walk(cache: object, prefix: str) -> Iterator[tuple[str, Sequence[object]]]:
    """Yield ``(path prefix, layers)`` for each layer list, descending into encoder-decoder caches."""
    layers = getattr(cache, "layers", None)
    if isinstance(layers, (list, tuple)):
        yield prefix, tuple(layers)  # a copy: another thread may append a layer while we read
        return
    sub_caches = [(name, getattr(cache, name, None)) for name in _SUB_CACHES]
    if all(sub is None for _, sub in sub_caches):
        raise NotACache(
            f"{type(cache).__name__} is not a transformers cache: it has neither .layers nor {' / '.join(_SUB_CACHES)}"
        )
    for name, sub in sub_caches:
        if sub is not None:
            yield from _walk(sub, f"{prefix}{name}.")


def _checked(tensor: object, tensor_type: type[Any], where: str) -> Any:
    if not isinstance(tensor, tensor_type):
        raise NotATensor(f"{where}: expected a torch.Tensor or None, got {type(tensor).__name__}")
    return tensor


def _measure_layer(path: str, layer: object, tensor_type: type[Any], seen: SeenStorages) -> LayerBytes:
    keys = getattr(layer, "keys", None)
    values = getattr(layer, "values", None)
    shown = 0
    allocated = 0
    for tensor in (keys, values):
        if tensor is None:
            continue
        _checked(tensor, tensor_type, path)
        shown += tensor.numel() * tensor.element_size()
        allocated += new_storage_bytes(tensor, seen)
    positions = int(keys.shape[-2]) if keys is not None and keys.dim() >= 2 else 0
    return LayerBytes(
        path=path,
        kind=type(layer).__name__,
        positions=positions,
        shown_bytes=shown,
        allocated_bytes=allocated,
    )


def new_storage_bytes(tensor: Any, seen: SeenStorages) -> int:
    """Bytes of the tensor's storage unless an earlier tensor already counted it.

    Keyed by device and data pointer: views (a sliding window's slice) and layers sharing KV point at the
    same storage. Empty storages all report pointer 0 and hold nothing, so they are skipped rather than keyed.
    """
    storage = _storage(tensor)
    nbytes: int = storage.nbytes()
    if nbytes == 0:
        return 0
    return nbytes if seen.add(tensor.device, storage) else 0


def _storage(tensor: Any) -> Any:
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError) as exc:  # torch's answer for sparse, nested and wrapper tensors
        raise StorageUnavailable(f"a cache holds a {type(tensor).__name__} without a readable storage ({exc})") from exc
