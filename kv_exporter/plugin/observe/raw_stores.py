"""Raw K/V stores of modules that declare nothing (docs/cache-bytes.md, "Beyond transformers caches", rule 3): a
layer-stacked tensor a module keeps in its own attributes for the attention its own config describes.

A module qualifies when it declares nothing and holds an attention config of the kind `spec_from_hf_config` reads
(`config.num_hidden_layers`, `num_key_value_heads` or `num_attention_heads`, `head_dim` or `hidden_size /
num_attention_heads`). A tensor counts when the module holds it itself (an attribute or registered buffer, an item
of a container held there, or a tensor of a plain object held there: `own_tensors`), not a parameter, of a floating
dtype, and its shape shows that config's K/V: a first dimension of the config's layer count (a store for every layer
at once), at least four dimensions, a last dimension of the head size (K or V alone) or twice it, and a dimension of
the KV heads between. vllm-omni's fish_speech and audio8 fast-AR `_k_cache` / `_v_cache` ([layers, batch, kv heads,
positions, head size]) and 0.32.0rc1's Qwen3 fused code-predictor `_kv_buf` and Qwen3-TTS FrameLocalKVCache `buffer`
([layers, 2, batch, kv heads, positions, head size]) are such stores. Per-layer stores (a KVCache module of each
layer, ring buffers in plain objects) show no layer count and are not counted by this rule. A store is charged to
the module that holds it, as undeclared: all of it unexplained.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple


class ConfigGeometry(NamedTuple):
    """The attention a module's own config describes: layers, KV heads, head size."""

    layers: int
    kv_heads: int
    head_dim: int


def config_geometry(module: Any) -> ConfigGeometry | None:
    """The geometry `module`'s own `config` describes, else None (no such config, or one that is not whole)."""
    config = vars(module).get("config")
    if config is None:
        return None
    try:
        layers = getattr(config, "num_hidden_layers", None)
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None)
        if not head_dim and isinstance(heads, int) and heads > 0:
            hidden = getattr(config, "hidden_size", None)
            head_dim = hidden // heads if isinstance(hidden, int) else None
    except Exception:  # a config whose attributes raise is no evidence of anything
        return None
    values = (layers, kv_heads, head_dim)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    return ConfigGeometry(*values)  # type: ignore[arg-type]


def store_evidence(tensor: Any, geometry: ConfigGeometry) -> bool:
    """Whether `tensor`'s shape is a layer-stacked K/V store of `geometry` (see the module docstring)."""
    shape = tuple(int(size) for size in tensor.shape)
    if len(shape) < 4 or not tensor.is_floating_point() or int(tensor.numel()) == 0:
        return False
    return (
        shape[0] == geometry.layers
        and shape[-1] in (geometry.head_dim, 2 * geometry.head_dim)
        and geometry.kv_heads in shape[1:-1]
    )


OWN_DEPTH = 2  # module -> attribute -> container or plain object -> tensor (FrameLocalKVCache.buffer: 1)


def own_tensors(module: Any, internals: frozenset[str], tensor_type: type, skip: tuple[type, ...]) -> Iterator[Any]:
    """The tensors `module` holds itself: its attributes (torch's own Module fields and its `config` aside), its
    registered buffers, and what containers and plain objects held there hold, `OWN_DEPTH` steps down; never
    through a value of a `skip` type (modules, caches the tracker follows, known cache classes)."""
    stop: tuple[type, ...] = (*_SCALARS, *skip)  # most attributes are one of these: the walk ends there
    pending = [
        (value, 0)
        for name, value in vars(module).items()
        if name not in internals and name != "config" and not isinstance(value, stop)
    ]
    pending.extend((value, 0) for value in getattr(module, "_buffers", {}).values() if value is not None)
    seen: set[int] = set()
    while pending:
        value, depth = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, tensor_type):
            yield value
        elif depth < OWN_DEPTH:
            pending.extend((child, depth + 1) for child in _items(value, stop) if not isinstance(child, stop))


_SCALARS: tuple[type, ...] = (str, bytes, int, float, bool, type(None))


def _items(value: Any, stop: tuple[type, ...]) -> list[Any]:
    """What a container or plain object holds one step down; nothing for a scalar or a `stop` type."""
    if isinstance(value, stop):
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    return list(vars(value).values()) if hasattr(value, "__dict__") and not isinstance(value, type) else []


__all__ = ["ConfigGeometry", "config_geometry", "own_tensors", "store_evidence"]
