"""The high-water mark per owner: the storage its live caches hold, and the most they held at any instant since the
last sample, each storage once, counted lazily.

What a cache holds can only fall in a few places: its release, the methods that rework its layers (`RESHAPING_METHODS`:
crop, reorder, reset, the batch reshapes, offload, prefetch, early initialisation) and the update of a layer that is
not a plain growing one (a sliding window drops positions; `GROWING_LAYERS` are the layers whose update only ever
replaces a storage by a larger one or writes in place). Everywhere else it can only grow. So a growing update only
marks its cache (one flag and a list entry), and the marked caches are read (`catch_up`) just before each
place where something may fall and at each sample: between two such instants every owner's total only rises, so its
maximum over the interval is one of the totals read then. The per-step path pays one mark per cache update, and a
read of each storage once per fall instead of once per update (docs/decisions/0011-peak-lazy-marks.md).

Each storage is kept once, by data pointer (one address space per process), with a count of the caches holding it,
charged to the owner of the first cache to hold it. A storage a cache dropped can only be freed after a change of
that cache, which marks it; a catch-up therefore first gives up what every marked cache dropped and only then takes
what they hold now, so an address freed by one and reused by another is never taken for the old storage.

A cache's last contents are read in its finalizer (the `__del__` the registry gives every cache class), where it
is still whole; nothing of it is kept alive for that (an entry holds a weak reference only, so a cache in any
reference cycle is collected as it would be without the plugin). What no hooked method announces (code assigning a
layer's `keys` itself, or calling a layer's `update` without its cache) is seen by the next read of that cache, or by
a sample's audit, which re-reads a few caches round robin.

The accounts themselves run in C (`_tracker.c`: the same rules, on the step path, in commits that run no Python);
this module names the methods they follow.
"""

from __future__ import annotations

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
