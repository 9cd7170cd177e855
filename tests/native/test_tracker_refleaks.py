"""The tracker leaks no reference and no memory: every operation of the step path and of a sample, repeated, leaves
what it touched as it found it. Real transformers caches and torch tensors, observed as the plugin observes them.

There is no debug CPython here (no sys.gettotalrefcount), so a leak is defined by what it would leave behind, after a
warm-up round has made whatever is made once (interned names, method caches, tallies, tables at their size):
- the reference counts of the long-lived objects each operation hands to or gets from the tracker (the tracker, its
  delegate, the cache and tensor classes, the update hook, the owner names, the code
  objects a frame walk reads) are back where they were;
- the objects the garbage collector tracks number the same, give or take the interpreter's own few (an Entry, a
  list or a dict kept is one more each round);
- tracemalloc, which sees PyMem_* and every object's allocation, counts no more bytes allocated from the lines of
  this file and of the observe package (a C allocation is traced to the Python line that called into the tracker;
  torch's own caches, which grow by some 50 KB over these rounds without the plugin, are traced to torch's and
  transformers' lines) than a few hundred.
A missing Py_DECREF of an object the tracker makes or gets on these paths breaks one of the three.
"""

from __future__ import annotations

import copy
import gc
import sys
import tracemalloc
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, EncoderDecoderCache
from transformers.cache_utils import Cache

from kv_exporter.plugin import observe
from tests.native.toolchain import OBSERVE
from tests.support.observing import observer, sample

__all__ = ["observer"]  # the fixture, imported for pytest

ROUNDS = 200
OWNER = "leak.owner"


def kv(positions: int) -> torch.Tensor:
    """Past 256 bytes: a storage's size is an int object of its own each reading, not a cached small one."""
    return torch.ones(1, 2, positions, 16)


class Maker(nn.Module):
    """Makes its caches in its own forward: attributed by the tracker's frame walk, once the model is known."""

    def forward(self, steps: int) -> DynamicCache:
        cache = DynamicCache()
        for layer in range(2):
            for _ in range(steps):
                cache.update(kv(3), kv(3), layer)
        return cache


def one_round(model: Maker, tracker: Any) -> None:
    """Every tracker operation once: track (attributed), mark by the C hook and by the Python wrapper, catch-ups at a
    reshaping method, a deep copy and a release, both halves of an encoder-decoder cache, tensors held, re-owned and
    let go, an audit, a rebuild, the introspection a sampler uses, and a sample's take."""
    cache = model(3)
    getattr(cache, "update")(kv(1), kv(1), 0)  # noqa: B009 (the wrapper, bound)
    twin = copy.deepcopy(cache)
    cache.crop(-2)
    both = EncoderDecoderCache(DynamicCache(), DynamicCache())
    both.self_attention_cache.update(kv(2), kv(2), 0)
    state = torch.zeros(64)
    tracker.hold(state, OWNER, False)
    tracker.reown(state, "leak.other")
    tracker.audit(-1)
    sample()
    tracker.let_go(state)
    tracker.hold(torch.zeros(32), OWNER, True)  # released by its weak reference's callback, at once
    tracker.entries()
    tracker.failures()
    tracker.sizes()
    tracker.rebuild()
    del cache, twin, both, state
    sample()


def watched(tracker: Any) -> dict[str, object]:
    registry = observe._observer.registry
    return {
        "tracker": tracker,
        "delegate": registry,
        "DynamicCache": DynamicCache,
        "EncoderDecoderCache": EncoderDecoderCache,
        "Tensor": torch.Tensor,
        "update hook": vars(Cache)["update"],
        "owner": sys.intern(OWNER),
        "the maker's code": Maker.forward.__code__,
    }


def references(tracker: Any) -> dict[str, int]:
    gc.collect()
    return {name: sys.getrefcount(value) for name, value in watched(tracker).items()}


def traced_here() -> int:
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, __file__), tracemalloc.Filter(True, str(OBSERVE / "*"))]
    )
    return sum(stat.size for stat in snapshot.statistics("filename"))


def test_repeated_tracker_operations_leave_no_reference_or_memory_behind(observer: None) -> None:
    model = Maker()
    observe.attach(model, [])
    tracker = observe._observer.registry.tracker
    tracemalloc.start(1)
    try:
        for _ in range(3):
            one_round(model, tracker)
        bytes_before, before, objects_before = traced_here(), references(tracker), len(gc.get_objects())
        for _ in range(ROUNDS):
            one_round(model, tracker)
        bytes_after, after, objects_after = traced_here(), references(tracker), len(gc.get_objects())
    finally:
        tracemalloc.stop()
    assert tracker.failures()[0] == 0, tracker.failures()
    assert after == before
    # A leak once a round is ROUNDS objects, or ROUNDS blocks of a pointer's size or more (an object is at least
    # two); what the interpreter keeps over the whole run is a few objects and a few hundred bytes.
    assert objects_after - objects_before < ROUNDS // 4, (objects_before, objects_after)
    assert bytes_after - bytes_before < 8 * ROUNDS, (bytes_before, bytes_after)
