"""Raw K/V stores of modules that declare nothing (docs/cache-bytes.md, "Beyond transformers caches", rules 3 and 4):
tensors a module keeps in its own state (`holders.Holders` walks it) for attention it runs, charged to that module,
undeclared: all of it unexplained. Two kinds of evidence, each proven free of false positives by the corpus over
every declaring module and root of vllm-omni 0.30.0 and 0.32.0rc1 (tests/omni/test_state_rule_corpus.py):

3. **A layer-stacked store for the attention the module's own config describes** (`config_geometry`: the config's
   layers, KV heads and head size as `protocol.hf_geometry` reads them for a declaration): a floating tensor of at
   least four dimensions, a first dimension of the layer count (a store for every layer at once), a last dimension
   of the head size (K or V alone) or twice it, and a dimension of the KV heads between. vllm-omni's fish_speech and
   audio8 fast-AR `_k_cache` / `_v_cache` ([layers, batch, kv heads, positions, head size]) and 0.32.0rc1's Qwen3
   fused code-predictor `_kv_buf` and Qwen3-TTS FrameLocalKVCache `buffer` ([layers, 2, batch, kv heads,
   positions, head size]).
4. **A per-layer store whose names say K/V and whose shape shows heads the module names** (`named_heads`,
   `heads_evidence`, `kv_name`). A name on the way from the module to the tensor (an attribute or a string dict
   key) says K/V (`kv`, or one of k, v, key(s), value(s) beside one of cache(s), ring(s), buf, buffer, past); and
   the tensor is floating, of at least three dimensions, with a last dimension of a head size (or twice it) and a
   head count before it, or a last dimension of heads x head size (heads fused, as Qwen3-TTS's streaming decoder
   keeps its rings), where the counts and sizes are what the module or the modules below it name in their own
   attributes (`num_heads`, `n_local_heads`, `head_dim`, `embed_dim // num_heads`, ...; never a config); a module
   that computes nothing (no `forward` of its own: a cache module) held by one naming heads is read in its heads.
   Names alone are not enough (the offsets beside a ring), nor is shape alone: Qwen3-TTS's streaming decoder keeps
   convolution histories of the same shape beside its K/V rings. fish_speech's DAC `KVCache` (its attention names
   the heads), DACStreamState's rings, personaplex's `_RingKV`, moss_tts's `_RingKVCache` / `RingKVCache` and
   Qwen3-TTS's `StreamingCodecDecoder` rings are such.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

from kv_exporter.protocol import hf_geometry


class ConfigGeometry(NamedTuple):
    """The attention a module's own config describes: layers, KV heads, head size."""

    layers: int
    kv_heads: int
    head_dim: int


def config_geometry(module: Any) -> ConfigGeometry | None:
    """The geometry `module`'s own `config` describes (`protocol.hf_geometry`), else None (no such config, or one
    that is not whole)."""
    config = vars(module).get("config")
    if config is None:
        return None
    try:
        values = hf_geometry(config)
    except Exception:  # a config that cannot say, or whose attributes raise, is no evidence of anything
        return None
    if not all(_whole(v) for v in values):
        return None
    return ConfigGeometry(*values)


def store_evidence(tensor: Any, geometry: ConfigGeometry) -> bool:
    """Rule 3: whether `tensor`'s shape is a layer-stacked K/V store of `geometry` (see the module docstring)."""
    shape = tuple(int(size) for size in tensor.shape)
    if len(shape) < 4 or not tensor.is_floating_point() or int(tensor.numel()) == 0:
        return False
    return (
        shape[0] == geometry.layers
        and shape[-1] in (geometry.head_dim, 2 * geometry.head_dim)
        and geometry.kv_heads in shape[1:-1]
    )


class Heads(NamedTuple):
    """The head counts and head sizes modules name in their own attributes (rule 4)."""

    counts: frozenset[int]
    sizes: frozenset[int]

    def union(self, other: Heads) -> Heads:
        return Heads(self.counts | other.counts, self.sizes | other.sizes)


NO_HEADS = Heads(frozenset(), frozenset())
HEAD_COUNTS = frozenset(
    {"num_heads", "n_heads", "n_head", "heads", "num_kv_heads", "n_kv_heads", "num_key_value_heads", "kv_heads",
     "n_local_heads", "num_local_heads", "num_attention_heads"}
)  # fmt: skip
HEAD_SIZES = frozenset({"head_dim", "head_size", "dim_per_head", "kv_head_dim"})
WIDTHS = frozenset({"embed_dim", "hidden_size", "dim", "d_model"})  # a head size is a width over a head count
HEAD_NAMES = HEAD_COUNTS | HEAD_SIZES | WIDTHS


def named_heads(module: Any) -> Heads:
    """The heads `module` names in its own attributes: counts, sizes, and each width its counts divide."""
    own = vars(module)
    # The names first (a set operation in C): most modules name none, and attach reads every module of the tree.
    named = {name: own[name] for name in own.keys() & HEAD_NAMES if _whole(own[name])}
    counts = frozenset(value for name, value in named.items() if name in HEAD_COUNTS)
    sizes = {value for name, value in named.items() if name in HEAD_SIZES}
    sizes.update(
        width // count for name, width in named.items() if name in WIDTHS for count in counts if not width % count
    )
    return Heads(counts, frozenset(sizes)) if counts and sizes else NO_HEADS


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def heads_evidence(tensor: Any, heads: Heads) -> bool:
    """Rule 4's shape: see the module docstring."""
    shape = tuple(int(size) for size in tensor.shape)
    if len(shape) < 3 or not tensor.is_floating_point() or int(tensor.numel()) == 0:
        return False
    last, before = shape[-1], shape[:-1]
    return any(
        (last in (size, 2 * size) and any(count in before for count in heads.counts))
        or any(last == count * size for count in heads.counts)
        for size in heads.sizes
    )


def named_kv(tensor: Any, named: bool, heads: Heads) -> bool:
    """Rule 4: a name on the way says K/V (`kv_name`) and the shape shows the named heads (`heads_evidence`)."""
    return named and heads_evidence(tensor, heads)


KV_WORDS = frozenset({"k", "v", "key", "keys", "value", "values"})
STORE_WORDS = frozenset({"cache", "caches", "ring", "rings", "buf", "buffer", "past"})


@functools.cache
def kv_name(name: str) -> bool:
    """Whether an attribute or dict key name says K/V: `kv`, or a K or V word beside a store word (`k_cache`,
    `value_cache`, `k_ring`, `past_key_values`, `_kv_buf`); a `k` or `v` alone (a scratch buffer) does not."""
    words = set(re.findall(r"[a-z0-9]+", name.lower()))
    return "kv" in words or bool(words & KV_WORDS and words & STORE_WORDS)


def subtree_heads(paths: Iterable[tuple[str, Heads]]) -> dict[str, Heads]:
    """path -> the heads its module and every module below it name, from each module's own (`named_heads`), given for
    every module of one tree by its dotted path (the root's is "")."""
    below = dict(paths)
    for path in sorted(below, key=lambda p: p.count(".") if p else -1, reverse=True):
        if path and below[path] != NO_HEADS:
            parent = path.rpartition(".")[0]
            below[parent] = below.get(parent, NO_HEADS).union(below[path])
    return below


__all__ = [
    "NO_HEADS",
    "ConfigGeometry",
    "Heads",
    "config_geometry",
    "heads_evidence",
    "kv_name",
    "named_heads",
    "named_kv",
    "store_evidence",
    "subtree_heads",
]
