"""A cache's `update` under observation: the interpreter's own call (`cache.update(...)`) takes the C hook, every
other access binds the Python wrapper; each way marks the cache once, and whatever reads the method reads it as
without the plugin. Real transformers caches."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from kv_exporter.plugin import observe
from kv_exporter.plugin.observe._tracker import UpdateHook
from tests.support.observing import observer

__all__ = ["observer"]  # the fixture, imported for pytest

pytestmark = pytest.mark.usefixtures("observer")


METHOD_DESCRIPTOR = 1 << 17  # Py_TPFLAGS_METHOD_DESCRIPTOR


def kv(positions: int) -> torch.Tensor:
    return torch.ones(1, 2, positions, 4)


def hook() -> UpdateHook:
    DynamicCache()  # the first instance of a class hooks it
    found = vars(Cache)["update"]
    assert isinstance(found, UpdateHook)
    return found


CALLS: dict[str, Callable[[Any, torch.Tensor], Any]] = {
    "method call": lambda c, k: c.update(k, k, 0),
    "keywords": lambda c, k: c.update(key_states=k, value_states=k, layer_idx=0),
    "unpacked": lambda c, k: c.update(*(k, k), **{"layer_idx": 0}),
    "bound method kept": lambda c, k: (lambda bound: bound(k, k, 0))(c.update),
    "getattr": lambda c, k: getattr(c, "update")(k, k, 0),  # noqa: B009 (an attribute read, not a method load)
    "through the class": lambda c, k: type(c).update(c, k, k, 0),
}


@pytest.mark.parametrize("call", CALLS)
def test_every_way_of_calling_update_marks_its_cache_once(call: str) -> None:
    tracker = observe._observer.registry.tracker
    cache = DynamicCache()
    before = tracker.marks
    keys, _ = CALLS[call](cache, kv(3))
    assert tracker.marks - before == 1
    assert keys.shape[2] == cache.get_seq_length() == 3


def test_a_subclass_calling_super_update_marks_for_both() -> None:
    class Forwarding(DynamicCache):
        def update(self, *args: Any, **kwargs: Any) -> Any:
            return super().update(*args, **kwargs)

    tracker = observe._observer.registry.tracker
    cache = Forwarding()
    before = tracker.marks
    cache.update(kv(2), kv(2), 0)
    assert tracker.marks - before == 2
    assert cache.get_seq_length() == 2


def python_frames(call: Callable[[], object]) -> set[CodeType]:
    """The code of every Python frame `call` ran."""
    seen: set[CodeType] = set()

    def profile(frame: FrameType, event: str, _: object) -> None:
        if event == "call":
            seen.add(frame.f_code)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def test_the_interpreter_s_call_takes_the_c_hook_and_every_other_access_the_wrapper() -> None:
    found, cache = hook(), DynamicCache()
    wrapper_code = found.wrapper.__code__
    assert wrapper_code not in python_frames(lambda: cache.update(kv(1), kv(1), 0))
    assert found.original.__code__ in python_frames(lambda: cache.update(kv(1), kv(1), 0))
    bound = cache.update
    assert wrapper_code in python_frames(lambda: bound(kv(1), kv(1), 0))
    assert DynamicCache.update is found.wrapper
    assert bound.__func__ is found.wrapper and bound.__self__ is cache


def test_the_hook_is_a_method_descriptor_that_binds_in_python() -> None:
    """Under the limited API the flag is set by the type's spec and `__get__` after it is made (wrappers.py): both must
    hold, or a method load binds the wrapper (a Python frame each update) or dynamo meets a C `__get__`."""
    found = hook()
    assert type(found) is UpdateHook
    assert UpdateHook.__flags__ & METHOD_DESCRIPTOR
    assert inspect.isfunction(vars(UpdateHook)["__get__"])
    cache = DynamicCache()
    assert found.__get__(cache, DynamicCache).__func__ is found.wrapper


def test_a_compiled_update_compiles_with_fullgraph_and_runs_the_original() -> None:
    def doubled(x: torch.Tensor) -> torch.Tensor:
        cache = DynamicCache()
        keys, _ = cache.update(x, x, 0)
        return keys * 2

    x = torch.ones(1, 2, 3, 4)
    assert torch.equal(torch.compile(doubled, backend="eager", fullgraph=True)(x), doubled(x))


def test_update_reads_as_the_original_wherever_it_is_read() -> None:
    found, cache = hook(), DynamicCache()
    original = found.original
    assert inspect.signature(cache.update) == inspect.signature(original.__get__(cache))
    assert inspect.signature(DynamicCache.update) == inspect.signature(original)
    assert inspect.getsource(DynamicCache.update) == inspect.getsource(original)
    for name in ("__name__", "__qualname__", "__doc__", "__module__"):
        assert getattr(DynamicCache.update, name) == getattr(cache.update, name) == getattr(original, name), name
    assert inspect.unwrap(DynamicCache.update) is inspect.unwrap(original)


def test_switched_off_update_is_the_original_and_marks_nothing() -> None:
    found, registry = hook(), observe._observer.registry
    switch = registry.step_switch()
    cache, tracker = DynamicCache(), registry.tracker
    switch(False)
    try:
        assert vars(Cache)["update"] is found.original
        before = tracker.marks
        cache.update(kv(2), kv(2), 0)
        assert tracker.marks == before
    finally:
        switch(True)
    assert vars(Cache)["update"] is found
    before = tracker.marks
    cache.update(kv(2), kv(2), 0)
    assert tracker.marks - before == 1
