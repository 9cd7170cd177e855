"""The high-water mark per owner: the storage its live caches hold, counted as it changes, and the most since the
last sample.

A cache's storage changes in its own methods: `update` (one layer: the lazy initialisation, the concatenation or
the in-place write), the methods that rework every layer (`crop`, `reorder_cache`, `reset`, the batch reshapes,
`offload`, `prefetch`, `early_initialization`), a new `layers` list (construction, `from_legacy_cache`) and a
copy's contents (`copy.copy` / `copy.deepcopy` call `__setstate__`). The registry wraps those (`CACHE_METHODS`,
on the cache base class and on every subclass that defines its own) to call `Accounts` after them; the accounts
then read the K and V tensors of the layers the call touched. Why not every attribute store of every layer (the
first design): a Python `__setattr__` on the layer classes made each of the stores a layer makes (its device, its
flags, its lazily made empty tensors) a Python call, and the accounting ran per tensor assigned rather than per
update: in the engine tests' in-step owner twice this design's cost (docs/benchmarks.md, section 7).

Each storage is kept once, by data pointer (one address space per process: CUDA's unified addressing gives host
and device memory distinct ones), with a count of the cache slots (a layer's K or V) holding it: it is charged to
the owner of the first cache to hold it and released when no tracked cache's slot holds it any more (the slot
given another tensor, or the cache gone: the registry's weak reference calls `forget`). A slot gives up its old
storage before it takes the new one, as the layer does.

What no wrapped method announces (upstream code assigning a layer's `keys` itself, or calling a layer's `update`
without its cache) is seen by the next wrapped call on that cache or by the sampler's walk: a sample's peak is
never below its own figure, and only such a change that comes and goes between two samples is missed.

An owner's `current` is what its caches hold now; `peak` the most they held at any instant since `take_peaks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kv_exporter.plugin.observe.owners import Geometry, Shape

# Cache methods after which any layer's K or V may be another storage (`update`: only the layer it names).
UPDATE_METHOD = "update"
CACHE_METHODS = (
    UPDATE_METHOD,
    "crop",
    "reorder_cache",
    "reset",
    "batch_repeat_interleave",
    "batch_select_indices",
    "offload",
    "prefetch",
    "early_initialization",
)
_NO_STORAGE = (AttributeError, TypeError, NotImplementedError, RuntimeError)  # sparse, nested, wrapper, a list


class Tally:
    """One owner's storage: now, and the most since the last sample."""

    __slots__ = ("current", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0


class _Held:
    """One storage: its size, how many tracked cache slots hold it, and whose it is."""

    __slots__ = ("nbytes", "refs", "tally")

    def __init__(self, nbytes: int, tally: Tally) -> None:
        self.nbytes = nbytes
        self.refs = 1
        self.tally = tally


class Accounts:
    """Per owner: the bytes its caches hold (each storage once over all owners) and the most since `take_peaks`.

    A tracked cache's registry entry carries two fields for this: `slots` (the data pointer each layer's K and V
    held when last looked at, 0 for none) and `tally` (its owner's, from its first storage on)."""

    def __init__(self, owner_of: Callable[[Any, Callable[[], Shape | None]], str]) -> None:
        self._owner_of = owner_of  # the owner to charge an entry's storage to (deciding it, by geometry, at its first)
        self.tallies: dict[str, Tally] = {}
        self._held: dict[int, _Held] = {}

    def updated(self, entry: Any, cache: Any, index: int) -> None:
        """`cache.update(..., index, ...)` has returned: its layer `index` may hold other storage."""
        layer = cache.layers[index]
        slot = index + index
        slots = entry.slots
        if len(slots) <= slot:
            slots.extend([0] * (slot + 2 - len(slots)))
        look = self._look
        look(entry, slots, slot, getattr(layer, "keys", None))
        look(entry, slots, slot + 1, getattr(layer, "values", None))

    def reworked(self, entry: Any, cache: Any) -> None:
        """Any of `cache`'s layers may hold other storage (a new `layers` list, a copy, crop, reorder, ...)."""
        layers = cache.__dict__.get("layers")
        if not isinstance(layers, list):  # a property (read only by the sampler, which says why) or no layers yet
            return
        slots = entry.slots
        count = 2 * len(layers)
        if len(slots) < count:
            slots.extend([0] * (count - len(slots)))
        look = self._look
        for index, layer in enumerate(layers):
            look(entry, slots, 2 * index, getattr(layer, "keys", None))
            look(entry, slots, 2 * index + 1, getattr(layer, "values", None))
        for pointer in slots[count:]:  # layers gone from the list
            self._release(pointer)
        del slots[count:]

    def forget(self, entry: Any) -> None:
        """`entry`'s cache is gone: its slots hold nothing now."""
        slots, entry.slots = entry.slots, []
        for pointer in slots:
            self._release(pointer)

    def _look(self, entry: Any, slots: list[int], slot: int, tensor: Any) -> None:
        """Slot `slot` of `entry` (`slots`: its list) holds `tensor` now."""
        try:
            storage = tensor.untyped_storage()
            nbytes: int = storage.nbytes()
            pointer: int = storage.data_ptr() if nbytes else 0
        except _NO_STORAGE:  # None, a tensor without storage, not a tensor: the sampler says which
            pointer = nbytes = 0
        old = slots[slot]
        if pointer == old:
            return
        held_by = self._held
        if old:  # first: the slot no longer holds it
            gone = held_by.get(old)
            if gone is not None:
                gone.refs -= 1
                if gone.refs <= 0:
                    del held_by[old]
                    gone.tally.current -= gone.nbytes
        slots[slot] = pointer
        if not pointer:
            return
        held = held_by.get(pointer)
        if held is not None:
            held.refs += 1
            return
        tally = entry.tally
        if tally is None:
            tally = entry.tally = self._tally(self._owner_of(entry, lambda: _shape(entry(), tensor)))
        held_by[pointer] = _Held(nbytes, tally)
        current = tally.current = tally.current + nbytes
        if current > tally.peak:
            tally.peak = current

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

    def take_peaks(self) -> dict[str, int]:
        """owner -> the most its caches held since the last call, for the owners that held anything; starts the
        next interval at what they hold now."""
        peaks = {}
        for owner, tally in list(self.tallies.items()):
            if tally.peak:
                peaks[owner] = tally.peak
            tally.peak = tally.current
        return peaks

    def rebuild(self, entries: Iterable[Any]) -> None:
        """Count again from the live caches (once their owners are known): what they hold now is the new peak."""
        self._held.clear()
        self.tallies.clear()
        for entry in entries:
            entry.slots, entry.tally = [], None
            cache = entry()
            if cache is not None and hasattr(cache, "__dict__"):
                self.reworked(entry, cache)


def _shape(cache: object, tensor: Any) -> Shape | None:
    """A cache's shape from its layer list and a K or V tensor shaped [batch, heads, positions, head size]."""
    shape, layers = tensor.shape, getattr(cache, "layers", None)
    if len(shape) != 4 or not isinstance(layers, list):
        return None
    dtype = str(tensor.dtype).removeprefix("torch.")
    growing = getattr(cache, "layer_class_to_replicate", None) is not None
    return Shape(Geometry(len(layers), int(shape[1]), int(shape[3]), dtype), growing)
