"""The high-water mark per owner: the storage its live caches hold, counted as it changes, and the most since the
last sample.

Every storage change of a transformers cache is an assignment to a layer's `keys` or `values` (`update`, the lazy
initialisation, `crop`, `reorder_cache`, `reset`, `offload`, and upstream code that sets them itself), a new
`layers` list, or a copy (`copy.copy` / `copy.deepcopy` fill the copy's `__dict__` and then call `__setstate__`).
The registry patches those three places (`__setattr__` of the layer base and of the cache base, `__setstate__` of
the cache base) to call `Accounts` here, which keeps each storage once, by data pointer (one address space per
process: CUDA's unified addressing gives host and device memory distinct addresses), with a count of the layer
slots holding it: a storage is charged to the owner of the first cache to hold it, and released when no tracked
layer holds it any more (the layer reassigned, or the layer gone: a weak reference's callback). What no assignment
announces (a tensor resized in place) the sampler's walk still sees: a sample's peak is never below its figure.

A layer belongs to the cache whose `layers` list held it when it was first seen (bound at `layers = [...]`, at a
copy, or, for a layer appended later, by the cache method on the stack that assigns its first tensor). Layers of no
tracked cache are not counted, as the sampler does not count them.

An owner's `current` is what its caches hold now; `peak` the most they held at any instant since `take_peaks`. An
assignment releases the old tensor's storage before it takes the new one's: the layer never holds both.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable
from types import CodeType, FrameType
from typing import Any

from kv_exporter.plugin.observe.owners import Geometry, Shape

TENSOR_SLOTS = ("keys", "values")
BIND_SEARCH_FRAMES = 8  # a layer's first tensor: the layer's method, its update, the cache's update, a helper


class Tally:
    """One owner's storage: now, and the most since the last sample."""

    __slots__ = ("current", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0


class _Held:
    """One storage: its size, how many tracked layer slots hold it, and whose it is."""

    __slots__ = ("nbytes", "refs", "tally")

    def __init__(self, nbytes: int, tally: Tally) -> None:
        self.nbytes = nbytes
        self.refs = 1
        self.tally = tally


class LayerRecord(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to one layer: the cache entry it belongs to and the storage each slot holds."""

    __slots__ = ("entry", "keys", "layer_id", "tally", "values")

    entry: Any  # the registry's Entry of its cache
    layer_id: int
    tally: Tally | None  # its cache's owner's, from its first storage on (the owner is settled by then)
    keys: int  # the storage's data pointer; 0: none
    values: int


class Accounts:
    """Per owner: the bytes its caches hold (each storage once over all owners) and the most since `take_peaks`."""

    def __init__(
        self, cache_of: Callable[[object], Any], owner_of: Callable[[Any, Callable[[], Shape | None]], str]
    ) -> None:
        self._cache_of = cache_of  # the entry of a tracked cache object, or None
        self._owner_of = owner_of  # the owner to charge an entry's storage to (deciding it, by geometry, at its first)
        self.tallies: dict[str, Tally] = {}
        self._held: dict[int, _Held] = {}
        self._layers: dict[int, LayerRecord] = {}
        self._on_release = self._layer_released
        self.cache_base: type | None = None  # set at install: only its methods' frames are asked for their `self`
        self._cache_methods: dict[int, tuple[CodeType, bool]] = {}  # id(code) -> (code, kept alive; is one)

    # -- events ---------------------------------------------------------------------------------------------------

    def assigned(self, layer: object, slot: str, tensor: object) -> None:
        """`layer.<slot> = tensor` has just happened (slot: keys or values)."""
        record = self._layers.get(id(layer))
        if record is None:
            if tensor is None:
                return
            entry = self._owning_entry(sys._getframe(2))
            if entry is not None:
                self.bind(layer, entry)
            return
        old = record.keys if slot == "keys" else record.values
        new = self._take(tensor, record, old)
        if slot == "keys":
            record.keys = new
        else:
            record.values = new

    def bind_all(self, layers: object, entry: Any) -> None:
        """The layers of `entry`'s cache (a new `layers` list, or a copy's)."""
        if isinstance(layers, (list, tuple)):
            for layer in tuple(layers):
                if id(layer) not in self._layers:
                    self.bind(layer, entry)

    def bind(self, layer: object, entry: Any) -> None:
        try:
            record = LayerRecord(layer, self._on_release)
        except TypeError:  # a layer object without weak references: left to the sampler
            return
        record.entry = entry
        record.layer_id = id(layer)
        record.tally = None
        record.keys = record.values = 0
        self._layers[record.layer_id] = record
        record.keys = self._take(getattr(layer, "keys", None), record, 0)
        record.values = self._take(getattr(layer, "values", None), record, 0)

    def _layer_released(self, record: LayerRecord) -> None:
        if self._layers.get(record.layer_id) is not record:  # counted before a rebuild: nothing of it is held now
            return
        del self._layers[record.layer_id]
        self._release(record.keys)
        self._release(record.values)

    # -- storage --------------------------------------------------------------------------------------------------

    def _take(self, tensor: Any, record: LayerRecord, old: int) -> int:
        """Hold `tensor`'s storage instead of `old`'s; the new data pointer (0: no tensor or no storage)."""
        pointer, nbytes = _storage(tensor)
        if pointer == old:
            return old
        if old:
            self._release(old)  # first: the slot no longer holds it
        if not pointer:
            return 0
        held = self._held.get(pointer)
        if held is not None:
            held.refs += 1
            return pointer
        tally = record.tally
        if tally is None:
            tally = record.tally = self._tally(self._owner_of(record.entry, lambda: _shape(record.entry(), tensor)))
        self._held[pointer] = _Held(nbytes, tally)
        tally.current += nbytes
        if tally.current > tally.peak:
            tally.peak = tally.current
        return pointer

    def _release(self, pointer: int) -> None:
        held = self._held.get(pointer)
        if held is None:
            return
        held.refs -= 1
        if held.refs <= 0:
            del self._held[pointer]
            held.tally.current -= held.nbytes

    def _tally(self, owner: str) -> Tally:
        tally = self.tallies.get(owner)
        if tally is None:
            tally = self.tallies[owner] = Tally()
        return tally

    # -- samples --------------------------------------------------------------------------------------------------

    def take_peaks(self) -> dict[str, int]:
        """owner -> the most its caches held since the last call, for the owners that held anything; starts the
        next interval at what they hold now."""
        peaks = {}
        for owner, tally in list(self.tallies.items()):
            if tally.peak:
                peaks[owner] = tally.peak
            tally.peak = tally.current
        return peaks

    def rebuild(self, entries: Iterable[Any], layers_of: Callable[[object], object]) -> None:
        """Count again from the live caches (once their owners are known): what they hold now is the new peak."""
        self._layers.clear()
        self._held.clear()
        self.tallies.clear()
        for entry in entries:
            cache = entry()
            if cache is not None:
                self.bind_all(layers_of(cache), entry)

    def _owning_entry(self, frame: FrameType | None) -> Any:
        """The tracked cache whose method (on the stack, within a few frames) assigns a new layer's first tensor.

        Only a cache method's frame is asked for its locals: on Python 3.11-3.12 that keeps a snapshot of them until
        the frame returns, which must not delay the release of anything a model's own frame holds."""
        methods = self._cache_methods
        for _ in range(BIND_SEARCH_FRAMES):
            if frame is None:
                return None
            code = frame.f_code
            known = methods.get(id(code))
            if known is None:
                known = methods[id(code)] = (code, self._is_cache_method(code, frame.f_globals))
            if known[1]:
                entry = self._cache_of(frame.f_locals.get(code.co_varnames[0]))
                if entry is not None:
                    return entry
            frame = frame.f_back
        return None

    def _is_cache_method(self, code: CodeType, namespace: dict[str, Any]) -> bool:
        """Whether `code` is a method of a cache class (by its qualified name, Python 3.11+)."""
        *class_path, _ = getattr(code, "co_qualname", "").split(".")
        if not class_path or self.cache_base is None or code.co_argcount < 1:
            return False
        owner: object = namespace.get(class_path[0])
        for name in class_path[1:]:
            owner = getattr(owner, name, None) if isinstance(owner, type) else None
        return isinstance(owner, type) and issubclass(owner, self.cache_base)


def _storage(tensor: Any) -> tuple[int, int]:
    """(data pointer, bytes) of a tensor's storage; (0, 0) for None, a non-tensor or an empty storage."""
    try:
        storage = tensor.untyped_storage()
    except (AttributeError, TypeError, NotImplementedError, RuntimeError):  # sparse, nested, wrapper: the sampler says
        return 0, 0
    nbytes: int = storage.nbytes()
    return (storage.data_ptr(), nbytes) if nbytes else (0, 0)


def _shape(cache: object, tensor: Any) -> Shape | None:
    """A cache's shape from its layer list and a K or V tensor shaped [batch, heads, positions, head size]."""
    shape, layers = tensor.shape, getattr(cache, "layers", None)
    if len(shape) != 4 or not isinstance(layers, list):
        return None
    dtype = str(tensor.dtype).removeprefix("torch.")
    growing = getattr(cache, "layer_class_to_replicate", None) is not None
    return Shape(Geometry(len(layers), int(shape[1]), int(shape[3]), dtype), growing)
