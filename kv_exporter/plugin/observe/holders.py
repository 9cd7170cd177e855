"""Model-local KV in forms other than a transformers `Cache`: a declaring owner's own tensors, and known cache classes
that live outside the model's module tree. What counts (docs/cache-bytes.md, "Beyond transformers caches"):

1. **A declaring owner's own state.** Every tensor reachable from the owner module's own attributes and registered
   buffers, through lists, tuples, sets, dicts and plain objects, at most `STATE_DEPTH` steps away, that shows one of
   the owner's declarations in its shape (`kv_evidence`): the declared dtype, a dimension of the declared KV heads
   and after it a last dimension of the declared head size (K or V alone) or twice it (K and V side by side). A
   buffer that merely holds a whole number of KV vectors is not KV (MiMo-Audio's audio-embedding staging buffer,
   `[100, 1, group, hidden]`, is not). Never through another module (it has its own figures; vLLM's attention modules
   hold the engine's paged KV), a transformers `Cache` (the tracker counts those) or a known cache class (rule 2);
   never a parameter, nor a storage of the engine's paged KV (the runner's `kv_caches`), wherever it is held.
   VibeVoice's negative-CFG pool (`[pages, kv heads, block, 2 x head size]` bf16) counts; its int32 block table, the
   owner's float32 rotary buffers, its config objects do not.
2. **Known cache classes** (`KNOWN_CLASSES`): the tensors their allocating methods store, from the moment they are
   stored until they are released, charged to the one declaring owner whose declaration their geometry matches
   (layers, KV heads, head size, dtype), else `unattributed`. vllm-omni 0.32's `StreamingAudioKVCache` (MiniCPM-o's
   streaming audio encoder sessions) is held in the duplex runtime's request state, and its `slots=True` instances
   cannot be weakly referenced: its buffer tensor is what is followed. Its `StreamingAudioGraphEncoder` (held by the
   thinker, which declares nothing) keeps one static KV input for all its CUDA graphs, captured lazily.
3. and 4. **Raw stores of modules that declare nothing** (`raw_stores.py`): a layer-stacked K/V tensor a module
   keeps for the attention its own config describes (fish_speech and audio8 fast-AR `_k_cache` / `_v_cache`, Qwen3's
   fused code-predictor `_kv_buf`), and a per-layer one whose names say K/V and whose shape shows heads the modules
   around it name (fish DAC `KVCache`, personaplex `_RingKV`, moss_tts ring caches, Qwen3-TTS streaming decoder
   rings), charged to the module holding it, undeclared. Never a vLLM attention layer (the engine's paged KV).

One walk of a module's own tensors (`Holders._own`) serves rules 1, 3 and 4.

Every tensor a rule finds is followed by the cache tracker's ledger (`Tracker.hold`), as a cache is: each
storage once across every form, an owner's peak the peak of everything it held together. The walks of rules 1, 3
and 4 run at the sample, in the sampler's slices; rule 2 costs nothing on the step path (its methods run once per page
of growth): a stored tensor is read as it is stored, while what it replaces still lives (that instant is the peak),
and gives its storage up when it is released.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any

from kv_exporter.observation import UNATTRIBUTED_OWNER
from kv_exporter.plugin.observe.owners import Geometry, ModelMap
from kv_exporter.plugin.observe.raw_stores import (
    NO_HEADS,
    ConfigGeometry,
    Heads,
    config_geometry,
    kv_name,
    named_heads,
    named_kv,
    store_evidence,
    subtree_heads,
)
from kv_exporter.plugin.oncelog import warn_once

STATE_DEPTH = 4  # owner -> attribute -> container or object -> ... -> tensor (VibeVoice: 3)
STATE_MAX_OBJECTS = 20_000  # a walk that meets more (a huge config graph) stops there and says so once
PATCHED_MARK = "__kv_exporter_holder__"


@dataclass(frozen=True)
class KnownClass:
    """A non-transformers cache class: where it is defined, the methods after which its KV tensors are read, the
    attributes holding them, and the geometry they have (from the instance and one of its tensors)."""

    module: str
    name: str
    allocating: tuple[str, ...]
    tensors: tuple[str, ...]
    geometry: Callable[[Any, Any], Geometry]


def _streaming_audio_geometry(cache: Any, tensor: Any) -> Geometry:
    """StreamingAudioKVCache: [layers, 2, capacity, embed_dim], embed_dim = heads x head size."""
    heads = int(cache.num_heads)
    return Geometry(int(cache.num_layers), heads, int(cache.embed_dim) // heads, _dtype(tensor))


def _graph_encoder_geometry(encoder: Any, tensor: Any) -> Geometry:
    """StreamingAudioGraphEncoder's static cache: [layers, 2, batch, positions, embed_dim]."""
    heads = int(encoder.num_heads)
    return Geometry(int(tensor.shape[0]), heads, int(encoder.embed_dim) // heads, _dtype(tensor))


_MINICPMO = "vllm_omni.model_executor.models.minicpmo_4_5"
KNOWN_CLASSES = (
    # One duplex session's encoder KV, grown in pages.
    KnownClass(
        f"{_MINICPMO}.streaming_audio_encoder",
        "StreamingAudioKVCache",
        allocating=("reserve",),
        tensors=("_buffer",),
        geometry=_streaming_audio_geometry,
    ),
    # The CUDA-graph encoder's static KV input, allocated by `capture` on the first duplex request (after the
    # engine's profiling); its mel, mask and position buffers beside it are not KV.
    KnownClass(
        f"{_MINICPMO}.streaming_audio_encoder_graph",
        "StreamingAudioGraphEncoder",
        allocating=("capture",),
        tensors=("_cache",),
        geometry=_graph_encoder_geometry,
    ),
)


class Holders:
    """Rules 1 to 4 above for one process: the known classes' stored tensors, the declaring owners' state and the
    other modules' raw stores, each tensor handed to the cache tracker's ledger (`tracker`, set when the tracker is
    installed)."""

    active: Holders | None = None  # where the patched methods report (the process's observer's; tests replace it)

    def __init__(self) -> None:
        self.tracker: Any = None
        self._model: ModelMap | None = None
        self._owners: dict[str, weakref.ref[Any]] = {}  # declaring path -> its module
        self._stores: dict[str, tuple[weakref.ref[Any], ConfigGeometry | None, Heads]] = {}  # rules 3 and 4
        self._store_ids: set[int] = set()  # the ids of `_stores`' and the declaring owners' modules
        self._known: tuple[type, ...] = ()  # the known classes found: rule 1 never enters them
        self._skip: tuple[type, ...] = ()  # nor modules, nor transformers caches (set by `attach`)
        self._engine_kv: set[tuple[str, int]] = set()  # (device, data pointer) of the engine's paged KV storages
        self._waiting: list[tuple[weakref.ref[Any], Geometry]] = []  # stored before the model was known
        self._state: dict[int, weakref.ref[Any]] = {}  # the state tensors the last walk found, by id

    # -- rule 2: known classes -----------------------------------------------------------------------------------

    def patches(self) -> dict[str, Callable[[ModuleType], None]]:
        """module name -> the patch wrapping its known classes' allocating methods (post-import hook)."""
        by_module: dict[str, list[KnownClass]] = {}
        for known in KNOWN_CLASSES:
            by_module.setdefault(known.module, []).append(known)
        return {name: functools.partial(self._patch, classes=tuple(known)) for name, known in by_module.items()}

    def _patch(self, module: ModuleType, classes: tuple[KnownClass, ...]) -> None:
        for known in classes:
            cls = getattr(module, known.name, None)
            if not isinstance(cls, type):
                warn_once(f"holder:{known.name}", "kv-exporter: %s has no class %s", module.__name__, known.name)
                continue
            self._known = (*self._known, cls)
            for name in known.allocating:
                method = vars(cls).get(name)
                if callable(method) and not hasattr(method, PATCHED_MARK):
                    setattr(cls, name, Holders._storing(method, known))

    @staticmethod
    def _storing(method: Callable[..., Any], known: KnownClass) -> Callable[..., Any]:
        @functools.wraps(method)
        def storing(*args: Any, **kwargs: Any) -> Any:
            # The tensors it holds before are kept until the new ones are held: a method that grows a buffer
            # allocates the new one while the old one lives (and copies), so that instant is the peak.
            instance = args[0] if args else None
            previous = [getattr(instance, name, None) for name in known.tensors]
            result = method(*args, **kwargs)
            holders = Holders.active
            unchanged = all(
                getattr(instance, name, None) is was for name, was in zip(known.tensors, previous, strict=True)
            )
            if holders is not None and not unchanged:  # most calls find room and store nothing
                try:
                    holders.stored(instance, known)
                except Exception as exc:  # never the model's failure
                    warn_once("holder:store", "kv-exporter: cannot follow a %s (%r)", known.name, exc)
            del previous
            return result

        setattr(storing, PATCHED_MARK, method)
        return storing

    def stored(self, instance: Any, known: KnownClass) -> None:
        """After an allocating method: hold each KV tensor `instance` now holds (the ledger skips one it holds)."""
        torch: Any = sys.modules.get("torch")
        tracker = self.tracker
        for attribute in known.tensors:
            tensor = getattr(instance, attribute, None)
            if tracker is None or torch is None or not isinstance(tensor, torch.Tensor):
                continue
            geometry = known.geometry(instance, tensor)  # Python of the class's own, before the ledger is touched
            owner = self._owner_of(geometry)
            if owner is None and self._model is None:
                self._waiting.append((weakref.ref(tensor), geometry))
            tracker.hold(tensor, UNATTRIBUTED_OWNER if owner is None else owner, True)

    def _owner_of(self, geometry: Geometry) -> str | None:
        """The one declaring owner whose declaration `geometry` matches; None (unattributed) for none or several."""
        if self._model is None:
            return None
        fitting = [owner for owner, shapes in self._model.declared.items() if geometry in shapes]
        return fitting[0] if len(fitting) == 1 else None

    # -- the model --------------------------------------------------------------------------------------------------

    def attach(self, model: ModelMap, cache_base: type | None, module_type: type, engine_kv: Iterable[Any]) -> None:
        """Know the declaring owners' modules, the modules rules 3 and 4 look at (those of the tree as loaded) and the
        engine's paged KV tensors (never counted, wherever a state holds them); name the owners of tensors stored
        before."""
        self._model = model
        self._engine_kv = {_storage_key(tensor) for tensor in engine_kv}
        root = model.root()
        self._owners = {}
        for path in model.declaring:
            module = _submodule(root, path)
            if module is not None:
                self._owners[path] = weakref.ref(module)
        modules = list(root.named_modules()) if root is not None else []
        self._stores = _store_modules(modules, model.declaring)
        # the modules rules 1, 3 and 4 look at already: no module is read as another's state
        self._store_ids = {id(ref()) for ref, _, _ in self._stores.values()} | {
            id(_submodule(root, p)) for p in model.declaring
        }
        self._skip = (module_type, cache_base) if cache_base is not None else (module_type,)
        waiting, self._waiting = self._waiting, []
        for ref, geometry in waiting:
            tensor, owner = ref(), self._owner_of(geometry)
            if tensor is not None and owner is not None and self.tracker is not None:
                self.tracker.reown(tensor, owner)

    # -- the sample -------------------------------------------------------------------------------------------------

    def walk_state(self, pace: Callable[[], None]) -> None:
        """Hold every tensor rules 1, 3 and 4 find now, and let go of those no longer there; `pace` is called as the
        walk goes (the sampler's slices)."""
        if self._model is None or self.tracker is None:
            return
        found: dict[int, weakref.ref[Any]] = {}
        for path, tensor in self._found(self._model, pace):
            if id(tensor) not in self._state and id(tensor) not in found:
                self.tracker.hold(tensor, path, False)
            found[id(tensor)] = weakref.ref(tensor)
        for key, ref in self._state.items():
            gone = ref()
            if key not in found and gone is not None:
                self.tracker.let_go(gone)
        self._state = found

    def _found(self, model: ModelMap, pace: Callable[[], None]) -> Iterator[tuple[str, Any]]:
        """(owner, tensor): rule 1 in each declaring owner's state, then rules 3 and 4 in the other modules'."""
        torch: Any = sys.modules.get("torch")
        if torch is None:
            return
        stop = (*_SCALARS, *self._skip_types())
        internals = _module_internals(torch)
        for path, module_ref in self._owners.items():
            module = module_ref()
            declared = model.declared.get(path, frozenset())
            if module is None or not declared:
                continue
            for tensor, _ in self._own(path, module, stop, internals, pace):
                if kv_evidence(tensor, declared) and not self._engines(tensor):
                    yield path, tensor
        for path, (module_ref, geometry, heads) in self._stores.items():
            module = module_ref()
            if module is None:
                continue
            yield from self._raw(path, module, geometry, heads, stop, internals, pace)
            if heads == NO_HEADS:
                continue
            # A module that computes nothing (no forward of its own) held by one naming heads is that one's state, in
            # those heads: fish's DAC attention gets a KVCache module from `setup_caches`, whenever that is called.
            for name, child in module._modules.items():
                if _state_module(child) and id(child) not in self._store_ids and not _vllm_attention(child):
                    yield from self._raw(f"{path}.{name}" if path else name, child, None, heads, stop, internals, pace)

    def _raw(
        self,
        path: str,
        module: Any,
        geometry: ConfigGeometry | None,
        heads: Heads,
        stop: tuple[type, ...],
        internals: frozenset[str],
        pace: Callable[[], None],
    ) -> Iterator[tuple[str, Any]]:
        """(path, tensor) for each raw store of `module`: rule 3 in its config's geometry, rule 4 in `heads`."""
        for tensor, named in self._own(path, module, stop, internals, pace):
            if (
                (geometry is not None and store_evidence(tensor, geometry)) or named_kv(tensor, named, heads)
            ) and not self._engines(tensor):
                yield path, tensor

    def _engines(self, tensor: Any) -> bool:
        """Whether `tensor` is a storage of the engine's paged KV (read only for a tensor a rule would count)."""
        return _storage_key(tensor) in self._engine_kv

    def _skip_types(self) -> tuple[type, ...]:
        """What no walk enters: modules, transformers caches, known cache classes, classes, functions, modules."""
        return (*self._skip, *self._known, type, FunctionType, MethodType, BuiltinFunctionType, ModuleType)

    def _own(
        self, path: str, module: Any, stop: tuple[type, ...], internals: frozenset[str], pace: Callable[[], None]
    ) -> Iterator[tuple[Any, bool]]:
        """(tensor, whether a name on the way says K/V) for every tensor `module` holds itself, the one walk of rules
        1, 3 and 4: its attributes (torch's own Module fields aside) and registered buffers, then what lists, tuples,
        sets, dicts and plain objects held there hold, at most `STATE_DEPTH` steps away; never through a `stop`
        value (a scalar, another module, a transformers cache, a known cache class) nor a config; never a
        parameter (the callers leave out the engine's paged KV among what their rules would count)."""
        torch: Any = sys.modules["torch"]
        pending: list[tuple[Any, int, bool]] = [
            (value, 1, kv_name(name))
            for name, value in vars(module).items()
            if type(value) not in _PLAIN and name not in internals and not _config(name) and not isinstance(value, stop)
        ]
        pending.extend((value, 1, kv_name(name)) for name, value in module._buffers.items() if value is not None)
        seen: set[int] = {id(module)}
        pace()
        while pending:
            value, depth, named = pending.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            if len(seen) > STATE_MAX_OBJECTS:
                warn_once(f"holder:walk:{path}", "kv-exporter: %r's state is too large to walk in full", path)
                return
            if isinstance(value, torch.Tensor):
                if not isinstance(value, torch.nn.Parameter):
                    yield value, named
            elif depth < STATE_DEPTH:
                pace()
                pending.extend(
                    (child, depth + 1, named or (name is not None and kv_name(name)))
                    for name, child in _children(value)
                    if type(child) not in _PLAIN and not (name and _config(name)) and not isinstance(child, stop)
                )


def _store_modules(
    modules: list[tuple[str, Any]], declaring: Collection[str]
) -> dict[str, tuple[weakref.ref[Any], ConfigGeometry | None, Heads]]:
    """path -> (module, its own config's geometry, the heads named around it) for every module of the tree (`modules`,
    as `named_modules` gives them) that rules 3 or 4 look at: one that declares nothing, is no vLLM attention layer
    and has a config geometry or named heads."""
    heads = subtree_heads((path, named_heads(module)) for path, module in modules)
    stores = {}
    for path, module in modules:
        if path in declaring or _vllm_attention(module):
            continue
        geometry = config_geometry(module)
        if geometry is not None or heads[path] != NO_HEADS:
            stores[path] = (weakref.ref(module), geometry, heads[path])
    return stores


def _state_module(module: Any) -> bool:
    """A module that computes nothing and holds no module: its class keeps torch's `forward`, which raises (a KVCache
    module; not a container of layers)."""
    torch: Any = sys.modules["torch"]
    return module is not None and type(module).forward is torch.nn.Module.forward and not module._modules


def _vllm_attention(module: Any) -> bool:
    """vLLM's attention layers (`get_kv_cache_spec`) hold the engine's paged KV: never a raw store."""
    # Its class, then its own attributes: a Module's `__getattr__`, where a lookup ends on a miss, is slow.
    return callable(getattr(type(module), "get_kv_cache_spec", None)) or callable(vars(module).get("get_kv_cache_spec"))


@functools.cache
def _module_internals(torch: Any) -> frozenset[str]:
    """The attributes every torch Module has of its own (its parameters, buffers, submodules, hooks, flags)."""
    return frozenset(vars(torch.nn.Module()))


def _storage_key(tensor: Any) -> tuple[str, int]:
    return str(tensor.device), int(tensor.untyped_storage().data_ptr())


def kv_evidence(tensor: Any, declared: Collection[Geometry]) -> bool:
    """Whether `tensor`'s shape shows one of the `declared` geometries' K/V layout: its dtype, a last dimension of the
    head size (K or V alone) or twice it (K and V side by side), and a dimension of the declaration's KV heads before
    it, with at least three dimensions in all. A whole number of KV vectors alone is no evidence: a hidden-state
    buffer has that."""
    shape = tuple(int(size) for size in tensor.shape)
    if len(shape) < 3 or int(tensor.numel()) == 0:
        return False
    dtype = _dtype(tensor)
    return any(
        dtype == g.dtype and shape[-1] in (g.head_dim, 2 * g.head_dim) and g.kv_heads in shape[:-1] for g in declared
    )


def _dtype(tensor: Any) -> str:
    """torch's own name of a tensor's dtype ("bfloat16"), as declarations spell theirs (kv_exporter.dtypes)."""
    return str(tensor.dtype).removeprefix("torch.")


def _children(value: Any) -> list[tuple[str | None, Any]]:
    """(name, child) one step down a container or plain object: attribute names and string dict keys, else None."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return [(None, child) for child in value]
    if isinstance(value, dict):
        return [(key if isinstance(key, str) else None, child) for key, child in value.items()]
    children: list[tuple[str | None, Any]] = list(vars(value).items()) if hasattr(value, "__dict__") else []
    for klass in type(value).__mro__:
        for name in getattr(klass, "__slots__", ()):
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                children.append((name, getattr(value, name, None)))
    return children


_SCALARS: tuple[type, ...] = (str, bytes, int, float, bool, type(None))
_PLAIN = frozenset(_SCALARS)  # most attributes are exactly one of these: one set lookup ends the walk there


def _config(name: str) -> bool:
    """A config (`config`, vLLM's `vllm_config`, `quant_config`, ...) describes; it never holds K/V and is large."""
    return name == "config" or name.endswith("_config")


def _submodule(root: Any, path: str) -> Any:
    if root is None:
        return None
    try:
        return root.get_submodule(path) if path else root
    except (AttributeError, TypeError):
        return None


__all__ = ["KNOWN_CLASSES", "Holders", "KnownClass", "kv_evidence"]
