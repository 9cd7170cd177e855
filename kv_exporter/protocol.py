"""The declaration protocol: what a model says it holds outside the paged KV manager.

Same names and semantics as vllm-omni 0.30's `vllm_omni/model_executor/models/model_local_kv.py`, without its
torch and vllm imports, so declarations can be built and read anywhere. A declaration describes; it never
allocates. Everything downstream (`kv_exporter.manifest.Declaration.from_spec`) also accepts vllm-omni's own
spec objects, duck-typed on these field names and enum values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

from kv_exporter.dtypes import dtype_itemsize, dtype_name

__all__ = [
    "HasModelLocalKV",
    "ModelLocalKVScope",
    "ModelLocalKVSpec",
    "RowDriver",
    "collect_model_local_kv_specs",
    "hf_geometry",
    "kv_row_bytes",
    "spec_from_hf_config",
]

logger = logging.getLogger(__name__)


class ModelLocalKVScope(str, Enum):
    """How long one allocation lives. Diagnostic only: lifetime is not multiplicity (`rows` is)."""

    INVOCATION = "invocation"  # dies when the call returns (a per-step working copy)
    REQUEST = "request"  # retained across the steps of one request
    SESSION = "session"  # outlives a request: a duplex / streaming session
    MODEL = "model"  # lives as long as the model (captured into a graph pool)


class RowDriver(str, Enum):
    """What sets how many rows of a cache are live at peak, and the rule that turns it into a row count.

    Every row count in kv-exporter comes from the three members below, so a new driver is added here, with its rule,
    and nowhere else branches on the value.
    """

    FIXED = "fixed"  # a count the model controls: rows_fixed, with rows_reason
    MAX_NUM_SEQS = "max_num_seqs"  # one row per in-flight sequence; only the engine knows the number

    @property
    def scales_with_max_num_seqs(self) -> bool:
        """Whether its rows follow the engine's sequences: a row per running sequence, max_num_seqs at peak, so
        raising max_num_seqs widens the cache (what `safe_max_num_seqs` searches over)."""
        return _RULES[self].per_sequence  # a member without a rule fails loudly, never as max_num_seqs

    @property
    def count_stated(self) -> bool:
        """Whether the declaration states the count itself: rows_fixed (>= 1) with a rows_reason a reviewer can
        check, required where it is."""
        return _RULES[self].count_stated

    def rows_at_ceiling(self, rows_fixed: int, max_num_seqs: int) -> int:
        """Rows live at peak, as vllm-omni counts them: rows_fixed for FIXED, max(1, max_num_seqs) for MAX_NUM_SEQS."""
        return rows_fixed if not self.scales_with_max_num_seqs else max(1, max_num_seqs)

    def rows_running(self, rows_fixed: int, running: int) -> int:
        """Rows live while `running` sequences run (0 allowed): rows_fixed for FIXED, else one per sequence."""
        return rows_fixed if not self.scales_with_max_num_seqs else max(0, running)


@dataclass(frozen=True)
class _Rule:
    """A driver's two facts, asked by name: they answer different questions (how its rows grow; what a declaration
    with it must state), which two drivers happen to answer oppositely."""

    per_sequence: bool
    count_stated: bool


_RULES = {
    RowDriver.FIXED: _Rule(per_sequence=False, count_stated=True),
    RowDriver.MAX_NUM_SEQS: _Rule(per_sequence=True, count_stated=False),
}


def kv_row_bytes(layers: int, kv_heads: int, head_dim: int, positions: int, itemsize: int) -> int:
    """Bytes for one batch row of a KV cache: K and V, every layer and head, every position."""
    return 2 * layers * kv_heads * head_dim * positions * itemsize


def _positive_int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelLocalKVSpec:
    """One declared KV allocation: one entry per distinct lifetime, not per cache object."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: object  # a torch.dtype or a dtype name such as "float32"
    physical_capacity_positions: int  # positions the tensor can physically hold, not the logical position
    capacity_source: str  # where the bound comes from; diagnostic text, never branched on
    scope: ModelLocalKVScope
    rows: RowDriver  # required: a default would silently understate every cache wider than one row
    rows_fixed: int = 1  # the count when rows is FIXED; ignored otherwise
    rows_reason: str = ""  # why rows_fixed is that number; required when rows is FIXED
    allocation_note: str | None = None

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim", "physical_capacity_positions"):
            _positive_int(field, getattr(self, field))
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("name must be a non-blank string")
        dtype_name(self.dtype)  # raises UnknownDTypeError early, at declaration time
        object.__setattr__(self, "scope", ModelLocalKVScope(self.scope))
        object.__setattr__(self, "rows", RowDriver(self.rows))
        if self.rows.count_stated:  # a count the model controls
            _positive_int("rows_fixed", self.rows_fixed)
            if not self.rows_reason.strip():
                raise ValueError(f"{self.name}: rows=FIXED needs a rows_reason; a bare constant cannot be reviewed")

    @property
    def bytes_per_row(self) -> int:
        return kv_row_bytes(
            self.layers, self.kv_heads, self.head_dim, self.physical_capacity_positions, dtype_itemsize(self.dtype)
        )

    def row_count(self, max_num_seqs: int = 1) -> int:
        return self.rows.rows_at_ceiling(self.rows_fixed, max_num_seqs)

    def peak_bytes(self, max_num_seqs: int = 1) -> int:
        return self.bytes_per_row * self.row_count(max_num_seqs)


@runtime_checkable
class HasModelLocalKV(Protocol):
    """Implemented by whichever object owns a cache (usually an inner module, not the registered model)."""

    def model_local_kv_specs(self) -> Sequence[ModelLocalKVSpec]: ...


def _first_attribute(config: object, names: Sequence[str], what: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(
        f"cannot determine {what} from {type(config).__name__} (tried {', '.join(names)}); "
        "pass it explicitly to spec_from_hf_config()"
    )


def spec_from_hf_config(
    config: object,
    *,
    name: str,
    physical_capacity_positions: int,
    capacity_source: str,
    scope: ModelLocalKVScope,
    dtype: object,
    rows: RowDriver,
    rows_fixed: int = 1,
    rows_reason: str = "",
    allocation_note: str | None = None,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
) -> ModelLocalKVSpec:
    """Build a spec from the same HF config the cache is built from.

    Geometry comes from the config unless overridden; an attribute that cannot be found raises instead of being
    guessed, since a silently wrong geometry under-reports. `rows` is keyword-required, as on the dataclass.
    """
    layers, kv_heads, head_dim = hf_geometry(config, layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    return ModelLocalKVSpec(
        name=name,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        physical_capacity_positions=physical_capacity_positions,
        capacity_source=capacity_source,
        scope=scope,
        rows=rows,
        rows_fixed=rows_fixed,
        rows_reason=rows_reason,
        allocation_note=allocation_note,
    )


def hf_geometry(
    config: object, *, layers: int | None = None, kv_heads: int | None = None, head_dim: int | None = None
) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of the attention an HF config describes, each given value kept. One reading
    for a declaration built from a config and for observation's raw-store rule (a module's own config): an attribute
    that cannot be found raises ValueError instead of being guessed."""
    if layers is None:
        layers = _first_attribute(config, ("num_hidden_layers", "encoder_layers", "num_layers"), "layer count")
    if kv_heads is None:
        kv_heads = _first_attribute(
            config, ("num_key_value_heads", "num_attention_heads", "encoder_attention_heads"), "KV head count"
        )
    if head_dim is None:
        head_dim = _head_dim(config)
    return layers, kv_heads, head_dim


def _head_dim(config: object) -> int:
    explicit = getattr(config, "head_dim", None)
    if explicit is not None:
        return int(explicit)
    hidden = _first_attribute(config, ("hidden_size", "d_model"), "hidden size")
    heads = _first_attribute(config, ("num_attention_heads", "encoder_attention_heads"), "attention head count")
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not a multiple of {heads} heads; pass head_dim explicitly")
    return hidden // heads


def _unwrap(model: object) -> object:
    """Follow the supported `unwrap()` accessor (vLLM's CUDAGraphWrapper) down to the real module tree.

    The wrapper forwards attribute access to its runnable, so entering through both would count a root-level
    declarer twice.
    """
    seen: set[int] = set()
    current = model
    while id(current) not in seen:
        seen.add(id(current))
        unwrap = getattr(current, "unwrap", None)
        if not callable(unwrap):
            break
        try:
            inner = unwrap()
        except Exception:
            break
        if inner is None or inner is current:
            break
        current = inner
    return current


def _owners(root: object) -> Iterable[tuple[str, HasModelLocalKV]]:
    """Every declarer in the tree, each once, the root first (path "")."""
    seen: set[int] = set()
    if isinstance(root, HasModelLocalKV):
        seen.add(id(root))
        yield "", root
    named_modules = getattr(root, "named_modules", None)
    if not callable(named_modules):
        return
    for path, module in named_modules():
        # A runtime-checkable isinstance costs ~9 us; modules declare through their class or instance dict, so
        # a plain lookup rules out the thousands that do not (10,000 modules: ~90 ms -> ~10 ms).
        if id(module) in seen or not _may_declare(module):
            continue
        if isinstance(module, HasModelLocalKV):
            seen.add(id(module))
            yield path, module


def _may_declare(module: object) -> bool:
    return hasattr(type(module), _DECLARING_METHOD) or _DECLARING_METHOD in getattr(module, "__dict__", ())


_DECLARING_METHOD = "model_local_kv_specs"


def collect_model_local_kv_specs(
    model: object, on_error: Callable[[str, BaseException], None] | None = None
) -> list[tuple[str, ModelLocalKVSpec]]:
    """Every declaration in a loaded model, as (owner_path, spec) pairs.

    A raising declaration is logged and skipped (and passed to `on_error` when given): reporting memory must
    never break model load. Declaring nothing is valid and yields nothing.
    """
    collected: list[tuple[str, ModelLocalKVSpec]] = []
    for path, owner in _owners(_unwrap(model)):
        try:
            specs = list(owner.model_local_kv_specs())
        except Exception as exc:
            logger.warning("model_local_kv_specs() raised on %s (%r); skipping it", path or "<root>", exc)
            if on_error is not None:
                on_error(path, exc)
            continue
        collected.extend((path, spec) for spec in specs)
    return collected
