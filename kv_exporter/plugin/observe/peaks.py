"""The high-water mark per owner: the storage its live caches hold, and the most they held at any instant since the
last sample, each storage once, counted lazily.

What a cache holds can only fall in a few places: its release, the methods that rework its layers (`RESHAPING_METHODS`:
crop, reorder, reset, the batch reshapes, offload, prefetch, early initialisation) and the update of a layer that is
not a plain growing one (a sliding window drops positions; `GROWING_LAYERS` are the layers whose update only ever
replaces a storage by a larger one or writes in place). Everywhere else it can only grow. So a growing update only
marks its cache (`Accounts.dirty`, one set insertion), and the marked caches are read (`catch_up`) just before each
place where something may fall and at each sample: between two such instants every owner's total only rises, so its
maximum over the interval is one of the totals read then. The per-step path pays one insertion per cache update,
and a read of each storage once per fall instead of once per update (docs/benchmarks.md, section 7).

Each storage is kept once, by data pointer (one address space per process), with a count of the caches holding it,
charged to the owner of the first cache to hold it. A storage a cache dropped can only be freed after a change of
that cache, which marks it; a catch-up therefore first gives up what every marked cache dropped and only then takes
what they hold now, so an address freed by one and reused by another is never taken for the old storage.

A cache is read through its instance dictionary, which its registry entry keeps: the weak reference's callback runs
when the cache is already unreachable but before its dictionary is cleared, so a released cache's last contents
are still read. What no hooked method announces (code assigning a layer's `keys` itself, or calling a layer's
`update` without its cache) is seen by the next read of that cache or by the sampler's walk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

# A layer's update that can make what its cache holds fall: every layer class but these two (exact types).
GROWING_LAYERS = ("DynamicLayer", "StaticLayer")
UPDATE_METHOD = "update"
RESHAPING_METHODS = (
    "crop",
    "reorder_cache",
    "reset",
    "batch_repeat_interleave",
    "batch_select_indices",
    "offload",
    "prefetch",
    "early_initialization",
)
_NO_STORAGE = (AttributeError, TypeError, NotImplementedError, RuntimeError)  # None, sparse, nested, a wrapper
_NOTHING: dict[int, int] = {}
_KV = ("keys", "values")


class Tally:
    """One owner's storage: now, and the most since the last sample."""

    __slots__ = ("current", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0


class Accounts:
    """Per owner: the bytes its caches hold (each storage once over all owners) and the most since `take_peaks`.

    Works on the registry's entries through four fields: `state` (the cache's instance dictionary), `ptrs` (data
    pointer -> bytes of the storages it held when last read), `tally` (its owner's, from its first storage on) and
    `cache_id` (its key in `dirty` and `live`)."""

    def __init__(
        self,
        live: dict[int, Any],
        owner_of: Callable[[Any, int], str],
        known_layers: set[type],
        layer_seen: Callable[[type], None],
    ) -> None:
        self._live = live  # id(cache) -> entry: the registry's
        self._owner_of = owner_of  # the owner to charge an entry's storage to, given its data pointer
        self._known_layers = known_layers  # the layer classes whose update is followed
        self._layer_seen = layer_seen
        self.tallies: dict[str, Tally] = {}
        self.dirty: set[int] = set()  # the caches that may hold more than when last read
        self.lock = threading.RLock()  # the sampler's thread catches up too
        self._held: dict[int, list[Any]] = {}  # data pointer -> [bytes, caches holding it, tally]

    def catch_up(self) -> None:
        """Read every marked cache: the totals then are at least what they were at any instant since the last read."""
        if not self.dirty:
            return
        with self.lock:
            self._catch_up()

    def _catch_up(self) -> None:
        dirty = self.dirty
        keys = list(dirty)
        dirty.difference_update(keys)  # a cache marked from now on is read again next time
        live, release, held = self._live, self._release, self._held
        read: list[tuple[Any, dict[int, int]]] = []
        for key in keys:  # first what each dropped: its address may hold another's storage now
            entry = live.get(key)
            if entry is None:
                continue
            now = self._storages(entry.state)
            for pointer in entry.ptrs:
                if pointer not in now:
                    release(pointer)
            read.append((entry, now))
        touched: set[Tally] = set()
        for entry, now in read:
            before, added = entry.ptrs, 0
            for pointer, nbytes in now.items():
                if pointer in before:
                    continue
                share = held.get(pointer)
                if share is not None:
                    share[1] += 1
                    continue
                tally = entry.tally
                if tally is None:
                    tally = entry.tally = self._tally(self._owner_of(entry, pointer))
                held[pointer] = [nbytes, 1, tally]
                added += nbytes
            entry.ptrs = now
            if added:
                tally = entry.tally
                tally.current += added
                touched.add(tally)
        for tally in touched:
            if tally.current > tally.peak:
                tally.peak = tally.current

    def released(self, entry: Any) -> None:
        """`entry`'s cache is gone (its dictionary still readable): count the instant before, then its storage goes."""
        if not entry.ptrs and entry.cache_id not in self.dirty:
            entry.state = None
            return
        with self.lock:
            if self.dirty:
                self._catch_up()
            release = self._release
            for pointer in entry.ptrs:
                release(pointer)
            entry.ptrs, entry.state = _NOTHING, None

    def _release(self, pointer: int) -> None:
        share = self._held.get(pointer)
        if share is None:
            return
        share[1] -= 1
        if share[1] <= 0:
            del self._held[pointer]
            share[2].current -= share[0]

    def _tally(self, owner: str) -> Tally:
        tally = self.tallies.get(owner)
        if tally is None:
            tally = self.tallies[owner] = Tally()
        return tally

    def _storages(self, state: dict[str, Any] | None) -> dict[int, int]:
        """data pointer -> bytes of every storage a cache's layers hold as K or V (nothing for what cannot be read:
        the sampler's walk says why)."""
        layers = None if state is None else state.get("layers")
        if type(layers) is not list:
            return _NOTHING
        found: dict[int, int] = {}
        known = self._known_layers
        for layer in layers:
            if type(layer) not in known:
                self._layer_seen(type(layer))
            for name in _KV:
                try:
                    storage = getattr(layer, name).untyped_storage()
                    nbytes: int = storage.nbytes()
                    if nbytes:
                        found[storage.data_ptr()] = nbytes
                except _NO_STORAGE:
                    pass
        return found

    def take_peaks(self) -> dict[str, int]:
        """owner -> the most its caches held since the last call, for the owners that held anything; starts the
        next interval at what they hold now."""
        with self.lock:
            self._catch_up()
            peaks = {}
            for owner, tally in list(self.tallies.items()):
                if tally.peak:
                    peaks[owner] = tally.peak
                tally.peak = tally.current
            return peaks

    def rebuild(self, entries: Iterable[Any]) -> None:
        """Count again from the live caches (once their owners are known): what they hold now is the new peak."""
        with self.lock:
            self._held.clear()
            self.tallies.clear()
            for entry in entries:
                entry.ptrs, entry.tally = _NOTHING, None
                self.dirty.add(entry.cache_id)
            self._catch_up()


def first_tensor(state: dict[str, Any] | None, pointer: int | None) -> Any:
    """The K or V tensor of a cache whose storage is at `pointer` (None: the first holding any), None when none is."""
    for layer in (state or {}).get("layers") or ():
        tensor: Any
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            try:
                storage = tensor.untyped_storage()
                if storage.data_ptr() == pointer or (pointer is None and storage.nbytes()):
                    return tensor
            except _NO_STORAGE:
                pass
    return None
