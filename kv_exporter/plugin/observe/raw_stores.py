"""Raw K/V stores of modules that declare nothing (docs/cache-bytes.md, "Beyond transformers caches", rule 3): a
layer-stacked tensor a module keeps in its own attributes for the attention its own config describes.

A module qualifies when it declares nothing and holds an attention config of the kind `spec_from_hf_config` reads
(`config.num_hidden_layers`, `num_key_value_heads` or `num_attention_heads`, `head_dim` or `hidden_size /
num_attention_heads`). A tensor counts when it is one of the module's own attributes or registered buffers (or an
item of a list or tuple held there), not a parameter, of a floating dtype, and its shape shows that config's K/V: a
first dimension of the config's layer count (a store for every layer at once), at least four dimensions, a last
dimension of the head size (K or V alone) or twice it, and a dimension of the KV heads between. vllm-omni's
fish_speech and audio8 fast-AR `_k_cache` / `_v_cache` ([layers, batch, kv heads, positions, head size]) and
0.32.0rc1's Qwen3 fused code-predictor `_kv_buf` ([layers, 2, batch, kv heads, positions, head size]) are such
stores. Per-layer stores (a KVCache module of each layer, ring buffers in plain objects) show no layer count and are
not counted by this rule. A store is charged to the module that holds it, as undeclared: all of it unexplained.
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


def own_tensors(module: Any, internals: frozenset[str], tensor_type: type) -> Iterator[Any]:
    """The tensors `module` holds itself: its attributes (torch's own Module fields aside), its registered buffers,
    and the items of lists and tuples held there."""
    values = [value for name, value in vars(module).items() if name not in internals]
    values.extend(getattr(module, "_buffers", {}).values())
    for value in values:
        if isinstance(value, tensor_type):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, tensor_type))


__all__ = ["ConfigGeometry", "config_geometry", "own_tensors", "store_evidence"]
