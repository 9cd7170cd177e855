"""Every live transformers cache in this process, from creation to release, held by weak references only.

`install` gives transformers' `Cache` base class a `__new__`: every subclass goes through it, and so does
`copy.deepcopy` (which creates the copy with `cls.__new__` and never runs `__init__`). It makes one weak
reference per cache (an `Entry`, which also carries the owner) and drops it from `live` when the cache is
released. Nothing else is patched: no per-step method pays anything.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Collection
from types import FrameType
from typing import Any

from kv_exporter.observation import UNATTRIBUTED_OWNER
from kv_exporter.plugin.observe.owners import ModelMap, ModuleRef, StackModules
from kv_exporter.plugin.oncelog import warn_once

PATCHED_MARK = "__kv_exporter_observe__"


class Entry(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to one cache, with its owner (None until the model is known, then `pending` names it)."""

    __slots__ = ("owner", "pending")

    owner: str | None
    pending: tuple[ModuleRef, ...]  # the modules on the creating stack, for a cache created before `attach`


class Registry:
    def __init__(self) -> None:
        self.live: dict[int, Entry] = {}  # id(entry) -> entry, in creation order
        self.model: ModelMap | None = None
        self.installed_on: type | None = None
        self.unavailable = ""  # why the figures cannot be complete in this process ("" while they can)
        self._stack_modules: StackModules | None = None
        self._on_release = self._released

    def _released(self, entry: Entry) -> None:
        self.live.pop(id(entry), None)

    def entries(self) -> list[Entry]:
        """A snapshot of the live entries (one C-level copy: other threads may create or release meanwhile)."""
        return list(self.live.values())

    def mark_unavailable(self, key: str, reason: str) -> None:
        warn_once(f"observe:{key}", "kv-exporter: cache observation unavailable: %s", reason)
        if not self.unavailable:
            self.unavailable = reason

    # -- tracking (runs inside every cache's creation) ----------------------------------------------------------

    def track(self, cache: object, frame: FrameType | None) -> None:
        try:
            entry = Entry(cache, self._on_release)
        except TypeError:
            name = type(cache).__qualname__
            self.mark_unavailable(f"weakref:{name}", f"{name} cannot be weakly referenced, so its caches go uncounted")
            return
        model = self.model
        if model is not None:
            entry.owner = self._owner_at(model, frame)
            entry.pending = ()
        else:
            entry.owner = None
            entry.pending = self._modules_on_stack(frame)
        self.live[id(entry)] = entry
        model = self.model
        if entry.owner is None and model is not None:  # `attach` ran while this cache was being registered
            self._settle(entry, model)

    @staticmethod
    def _owner_at(model: ModelMap, frame: FrameType | None) -> str:
        try:
            return model.owner_at(frame)
        except Exception as exc:  # a strange frame must not lose the cache: count it, unattributed
            warn_once(
                "observe:owner", "kv-exporter: cannot attribute a cache (%s); counting it as unattributed", repr(exc)
            )
            return UNATTRIBUTED_OWNER

    def _modules_on_stack(self, frame: FrameType | None) -> tuple[ModuleRef, ...]:
        if self._stack_modules is None:
            return ()
        try:
            return self._stack_modules.on_stack(frame)
        except Exception as exc:  # as above: the cache is counted, it will be unattributed
            warn_once("observe:stack", "kv-exporter: cannot read a cache's creating stack (%s)", repr(exc))
            return ()

    @staticmethod
    def _settle(entry: Entry, model: ModelMap) -> None:
        entry.owner = model.resolve(entry.pending)
        entry.pending = ()

    # -- the model ------------------------------------------------------------------------------------------------

    def attach(self, model: object, declaring_owner_paths: Collection[str], module_type: type[Any]) -> None:
        """Know the model from now on, and name the owners of the caches created before (their modules' paths)."""
        if self.model is not None and self.model.describes(model, declaring_owner_paths):
            return
        self.model = ModelMap(model, declaring_owner_paths, module_type, on_release=self._model_released)
        for entry in self.entries():
            if entry.owner is None:
                self._settle(entry, self.model)

    def _model_released(self, root: ModuleRef) -> None:
        if self.model is not None and self.model.root is root:
            self.model = None

    # -- installation ---------------------------------------------------------------------------------------------

    def install(self, cache_base: type, module_type: type[Any]) -> bool:
        """Track every instance of `cache_base` and its subclasses from now on; False when that cannot work."""
        if cache_base.__weakrefoffset__ == 0:
            name = cache_base.__qualname__
            self.mark_unavailable(f"weakref:{name}", f"{name} cannot be weakly referenced; nothing is tracked")
            return False
        self._stack_modules = StackModules(module_type)
        own_new = cache_base.__dict__.get("__new__")
        tracker = getattr(getattr(own_new, "__func__", own_new), PATCHED_MARK, None)
        if isinstance(tracker, _Tracker):  # patched before (an earlier registry, in tests): track into this one
            tracker.registry = self
        else:
            cache_base.__new__ = staticmethod(_tracking_new(cache_base, own_new, _Tracker(self)))  # type: ignore[method-assign]
        self.installed_on = cache_base
        return True

    def detach(self) -> None:
        """Stop tracking into this registry (tests). The `__new__` stays: CPython cannot give a class back the
        `object.__new__` it inherited once it has had its own (deleting it leaves a slot that refuses arguments)."""
        cache_base, self.installed_on = self.installed_on, None
        own_new = None if cache_base is None else cache_base.__dict__.get("__new__")
        tracker = getattr(getattr(own_new, "__func__", own_new), PATCHED_MARK, None)
        if isinstance(tracker, _Tracker) and tracker.registry is self:
            tracker.registry = None


class _Tracker:
    """Where the patched `__new__` tracks to (None: nowhere)."""

    __slots__ = ("registry",)

    def __init__(self, registry: Registry | None) -> None:
        self.registry = registry


def _tracking_new(cache_base: type[Any], own_new: Any, tracker: _Tracker) -> Any:
    """The `__new__` to put on `cache_base`: create the instance as before, then track it, never raising."""
    original = getattr(own_new, "__func__", own_new)  # a `__new__` the class defines itself, else None
    object_new = object.__new__
    is_compiling = _compiling_test()

    def __new__(cls: type[Any], *args: Any, **kwargs: Any) -> Any:
        if original is not None:
            instance = original(cls, *args, **kwargs)
        else:
            upstream = super(cache_base, cls).__new__
            # object.__new__ refuses arguments once a class overrides __new__; __init__ takes them.
            instance = object_new(cls) if upstream is object_new else upstream(cls, *args, **kwargs)
        registry = tracker.registry
        if registry is not None and not is_compiling():
            try:
                registry.track(instance, sys._getframe(1))
            except Exception as exc:
                registry.mark_unavailable("track", f"tracking a {cls.__qualname__} failed ({exc!r})")
        return instance

    setattr(__new__, PATCHED_MARK, tracker)
    return __new__


def _compiling_test() -> Callable[[], bool]:
    """torch.compiler.is_compiling: True while dynamo traces. The frame walk is not traceable (sys._getframe) and
    would break a fullgraph compile of code that makes a cache. The price: a cache made inside compiled code and
    kept after it goes uncounted (dynamo recreates it at run time with `object.__new__`, past this one)."""
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    test = getattr(compiler, "is_compiling", None)
    return test if callable(test) else lambda: False
