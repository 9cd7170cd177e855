"""Every live transformers cache in this process, from creation to release, held by weak references only.

`install` gives transformers' `Cache` base class a `__new__`: every subclass goes through it, and so does
`copy.deepcopy` (which creates the copy with `cls.__new__` and never runs `__init__`). It makes one weak
reference per cache (an `Entry`, which also carries the owner) and drops it from `live` when the cache is
released. For the high-water mark (`peaks.Accounts`) it wraps the cache methods that change what a cache's layers
hold (`peaks.CACHE_METHODS`, on the base class and on each subclass that defines its own, as it is first seen),
and gives the cache base class a `__setattr__` that reports a new `layers` list and a `__setstate__` (what a copy's
contents arrive through): the per-step cost is one call per cache update.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Collection, Mapping
from types import FrameType
from typing import Any

from kv_exporter.observation import UNATTRIBUTED_OWNER
from kv_exporter.plugin.observe.owners import Attribution, Geometry, ModelMap, ModuleRef, Shape, StackModules
from kv_exporter.plugin.observe.peaks import CACHE_METHODS, UPDATE_METHOD, Accounts, Tally
from kv_exporter.plugin.oncelog import warn_once

PATCHED_MARK = "__kv_exporter_observe__"


class Entry(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to one cache, with its owner (None until the model is known, then `pending` names it)."""

    __slots__ = ("cache_id", "candidate", "owner", "pending", "slots", "tally")

    cache_id: int
    owner: str | None
    candidate: str | None  # a declaring ancestor whose declared memory the cache may be, until its first tensor
    pending: tuple[ModuleRef, ...]  # the modules on the creating stack, for a cache created before `attach`
    slots: list[int]  # the accounts': the storage each layer's K and V held when last looked at
    tally: Tally | None  # the accounts': its owner's, from its first storage on


class Registry:
    def __init__(self) -> None:
        self.live: dict[int, Entry] = {}  # id(entry) -> entry, in creation order
        self.by_cache: dict[int, Entry] = {}  # id(cache) -> entry
        self.accounts = Accounts(self._charge)
        self.model: ModelMap | None = None
        self.installed_on: type | None = None
        self.unavailable = ""  # why the figures cannot be complete in this process ("" while they can)
        self._stack_modules: StackModules | None = None
        self._wrapped: set[type] = set()  # cache classes whose own storage methods report to the accounts
        self._on_release = self._released

    def _released(self, entry: Entry) -> None:
        self.live.pop(id(entry), None)
        if self.by_cache.get(entry.cache_id) is entry:
            del self.by_cache[entry.cache_id]
        self.accounts.forget(entry)

    def entry_of(self, cache: object) -> Entry | None:
        entry = self.by_cache.get(id(cache))
        return entry if entry is not None and entry() is cache else None

    def _charge(self, entry: Entry, shape_of: Callable[[], Shape | None]) -> str:
        """The owner a new storage of `entry`'s cache is charged to; its first tensor settles a candidate."""
        candidate = entry.candidate
        if candidate is not None and entry.owner is not None:
            entry.candidate = None
            model, shape = self.model, shape_of()
            if shape is not None and model is not None and model.declares(candidate, shape):
                entry.owner = candidate
        return UNATTRIBUTED_OWNER if entry.owner is None else entry.owner  # as the sampler says before `attach`

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
        entry.cache_id = id(cache)
        entry.candidate = None
        entry.slots, entry.tally = [], None
        cls = type(cache)
        if cls not in self._wrapped:
            self._wrap(cls)
        model = self.model
        if model is not None:
            entry.owner, entry.candidate = self._owner_at(model, frame)
            entry.pending = ()
        else:
            entry.owner = None
            entry.pending = self._modules_on_stack(frame)
        self.live[id(entry)] = entry
        self.by_cache[entry.cache_id] = entry
        model = self.model
        if entry.owner is None and model is not None:  # `attach` ran while this cache was being registered
            self._settle(entry, model)

    @staticmethod
    def _owner_at(model: ModelMap, frame: FrameType | None) -> Attribution:
        try:
            return model.owner_at(frame)
        except Exception as exc:  # a strange frame must not lose the cache: count it, unattributed
            warn_once(
                "observe:owner", "kv-exporter: cannot attribute a cache (%s); counting it as unattributed", repr(exc)
            )
            return Attribution(UNATTRIBUTED_OWNER)

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
        entry.owner, entry.candidate = model.resolve(entry.pending)
        entry.pending = ()

    # -- the model ------------------------------------------------------------------------------------------------

    def attach(self, model: object, declared: Mapping[str, Collection[Geometry]], module_type: type[Any]) -> None:
        """Know the model from now on, and name the owners of the caches created before (their modules' paths).

        `declared`: each declaring owner's path -> the geometries of its declarations."""
        if self.model is not None and self.model.describes(model, declared):
            return
        self.model = ModelMap(model, declared, module_type, on_release=self._model_released)
        entries = self.entries()
        for entry in entries:
            if entry.owner is None:
                self._settle(entry, self.model)
        self.accounts.rebuild(entries)

    def _model_released(self, root: ModuleRef) -> None:
        if self.model is not None and self.model.root is root:
            self.model = None

    # -- installation ---------------------------------------------------------------------------------------------

    def install(self, cache_base: type, module_type: type[Any]) -> bool:
        """Track every instance of `cache_base` and its subclasses from now on, and what their layers hold as it
        changes; False when that cannot work."""
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
            tracker = _Tracker(self)
            cache_base.__new__ = staticmethod(_tracking_new(cache_base, own_new, tracker))  # type: ignore[method-assign]
        _Contents.registry = self
        _Contents.is_compiling = staticmethod(_compiling_test())
        self.installed_on = cache_base
        _patch_cache_base(cache_base)
        pending = [cache_base]
        while pending:  # the classes defined by now; later ones as their first instance is tracked
            cls = pending.pop()
            self._wrap(cls)
            pending.extend(cls.__subclasses__())
        return True

    def _wrap(self, cls: type) -> None:
        """Report `cls`'s own storage methods (and its bases' up to the cache base) to the accounts."""
        cache_base = self.installed_on
        if cache_base is None:
            return
        for klass in cls.__mro__:
            if klass in self._wrapped or not issubclass(klass, cache_base):
                continue
            self._wrapped.add(klass)
            for name in CACHE_METHODS:
                method = vars(klass).get(name)
                if callable(method) and not hasattr(method, PATCHED_MARK):
                    setattr(klass, name, _reporting(method, name == UPDATE_METHOD))

    def detach(self) -> None:
        """Stop tracking into this registry (tests, benchmarks). The content hooks go; the `__new__` stays: CPython
        cannot give a class back the `object.__new__` it inherited once it has had its own (deleting it leaves a slot
        that refuses arguments)."""
        cache_base, self.installed_on = self.installed_on, None
        own_new = None if cache_base is None else cache_base.__dict__.get("__new__")
        tracker = getattr(getattr(own_new, "__func__", own_new), PATCHED_MARK, None)
        if isinstance(tracker, _Tracker) and tracker.registry is self:
            tracker.registry = _Contents.registry = None
            for klass in self._wrapped:
                for name, method in list(vars(klass).items()):
                    original = getattr(method, PATCHED_MARK, None)
                    if name in CACHE_METHODS and original is not None:
                        setattr(klass, name, original)
            for name, hook in (("__setattr__", _cache_setattr), ("__setstate__", _cache_setstate)):
                if cache_base is not None and vars(cache_base).get(name) is hook:
                    delattr(cache_base, name)
        self._wrapped.clear()


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


class _Contents:
    """Where the content hooks report: module state, not closure cells (dynamo wraps a traced function's cells
    when it inlines it, and cannot wrap a registry; a global it never loads while tracing costs nothing)."""

    registry: Registry | None = None  # the installed one; None once detached
    is_compiling: Callable[[], bool] = staticmethod(lambda: False)


def _reporting(method: Callable[..., Any], one_layer: bool) -> Callable[..., Any]:
    """`method` of a cache class, then the accounts told what its layers hold now (only the layer an update
    names). The call itself is as before; the report never raises into transformers, and steps aside while dynamo
    traces (as `__new__` does: what compiled code holds is seen at the next sample)."""

    @functools.wraps(method)
    def reporting(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        registry = None if _Contents.is_compiling() else _Contents.registry
        if registry is not None:
            entry = registry.by_cache.get(id(self))
            if entry is not None and entry() is self:
                try:
                    index = args[2] if len(args) > 2 else kwargs.get("layer_idx")
                    if one_layer and type(index) is int:
                        registry.accounts.updated(entry, self, index)
                    else:
                        registry.accounts.reworked(entry, self)
                except Exception as exc:
                    _peak_failed(registry, exc)
        return result

    setattr(reporting, PATCHED_MARK, method)
    return reporting


def _patch_cache_base(cache_base: type[Any]) -> None:
    """A new `layers` list and a copy's contents reported to the accounts, as the wrapped methods are."""
    if "__setattr__" not in vars(cache_base):
        setattr(cache_base, "__setattr__", _cache_setattr)  # noqa: B010 (a class attribute, not a type error)
    if "__setstate__" not in vars(cache_base):
        setattr(cache_base, "__setstate__", _cache_setstate)  # noqa: B010


def _cache_setattr(self: Any, name: str, value: Any) -> None:
    _store(self, name, value)
    if name == "layers" and not _Contents.is_compiling():
        _report_layers(self)


def _cache_setstate(self: Any, state: Any) -> None:
    # What copy and pickle do without a __setstate__: the dict, then any slots.
    state, slots = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
    if state:
        self.__dict__.update(state)
    for key, value in (slots or {}).items():
        setattr(self, key, value)
    if not _Contents.is_compiling():
        _report_layers(self)


def _report_layers(cache: Any) -> None:
    registry = _Contents.registry
    entry = None if registry is None else registry.entry_of(cache)
    if registry is not None and entry is not None:
        try:
            registry.accounts.reworked(entry, cache)
        except Exception as exc:
            _peak_failed(registry, exc)


def _peak_failed(registry: Registry, exc: Exception) -> None:
    registry.mark_unavailable("peak", f"the high-water mark cannot follow a cache ({exc!r})")


def _store(obj: Any, name: str, value: Any) -> None:
    """What `object.__setattr__` does, through the instance dict where no descriptor intervenes: dynamo traces a
    `__setattr__` that stores that way, and recurses without end into one that calls `object.__setattr__`."""
    cls = type(obj)
    guarded = _GUARDED.get(cls)
    if guarded is None:
        guarded = _GUARDED[cls] = _guarded_names(cls)
    if name in guarded:
        object.__setattr__(obj, name, value)
        return
    try:
        obj.__dict__[name] = value
    except AttributeError:  # no instance dict (slots only)
        object.__setattr__(obj, name, value)


# class -> the attribute names a store must leave to object.__setattr__ (data descriptors: properties, slots). A plain
# dict: a lookup on every attribute store of a cache or layer (a WeakKeyDictionary's costs ~0.5 us), and cache
# classes are few and live as long as the process.
_GUARDED: dict[type, frozenset[str]] = {}


def _guarded_names(cls: type) -> frozenset[str]:
    return frozenset(
        name for klass in cls.__mro__ for name, value in vars(klass).items() if hasattr(type(value), "__set__")
    )


def _compiling_test() -> Callable[[], bool]:
    """torch.compiler.is_compiling: True while dynamo traces. The frame walk is not traceable (sys._getframe) and
    would break a fullgraph compile of code that makes a cache. The price: a cache made inside compiled code and
    kept after it goes uncounted (dynamo recreates it at run time with `object.__new__`, past this one)."""
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    test = getattr(compiler, "is_compiling", None)
    return test if callable(test) else lambda: False
