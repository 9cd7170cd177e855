"""Every live transformers cache in this process, from creation to release, held by weak references only.

`install` gives transformers' `Cache` base class a `__new__`: every subclass goes through it, and so does
`copy.deepcopy` (which creates the copy with `cls.__new__` and never runs `__init__`). It makes one weak
reference per cache (an `Entry`, which also carries the owner) and drops it from `live` when the cache is
released. Where the high-water mark is followed (`peaks.Accounts`, KV_EXPORTER_OBSERVE_PEAK) it also wraps the
methods that change what a cache's layers hold (`update` and `peaks.RESHAPING_METHODS`, on the base class and on
each subclass that defines its own, as it is first seen): the per-step cost is one call per cache update, and a
read of the marked caches before each fall. Where it is not, nothing but the creation and the release is hooked.
"""

from __future__ import annotations

import copyreg
import functools
import sys
import weakref
from collections.abc import Callable, Collection, Mapping
from types import FrameType
from typing import Any

from kv_exporter.observation import UNATTRIBUTED_OWNER
from kv_exporter.plugin.observe.owners import Attribution, Geometry, ModelMap, ModuleRef, Shape, StackModules
from kv_exporter.plugin.observe.peaks import (
    _NOTHING,
    GROWING_LAYERS,
    RESHAPING_METHODS,
    UPDATE_METHOD,
    Accounts,
    Tally,
    first_tensor,
)
from kv_exporter.plugin.oncelog import warn_once

PATCHED_MARK = "__kv_exporter_observe__"
# What `copy.copy`, `copy.deepcopy` and `pickle` create an instance through (its `__new__`'s caller).
_COPYING = frozenset(getattr(copyreg, name).__code__ for name in ("__newobj__", "__newobj_ex__"))
LAYER_BASE = "CacheLayerMixin"  # the cache module's layer base class (transformers 4.56 and later)


class Entry(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to one cache, with its owner (None until the model is known, then `pending` names it) and
    what the accounts need (peaks.Accounts)."""

    __slots__ = ("cache_id", "candidate", "owner", "pending", "ptrs", "state", "tally")

    cache_id: int
    owner: str | None
    candidate: str | None  # a declaring ancestor whose declared memory the cache may be, until its first storage
    pending: tuple[ModuleRef, ...]  # the modules on the creating stack, for a cache created before `attach`
    state: dict[str, Any] | None  # the cache's instance dictionary: still readable in the release callback
    ptrs: dict[int, int]  # the accounts': data pointer -> bytes of what it held when last read
    tally: Tally | None  # the accounts': its owner's, from its first storage on


class Registry:
    def __init__(self) -> None:
        self.live: dict[int, Entry] = {}  # id(cache) -> entry, in creation order
        self.model: ModelMap | None = None
        self.installed_on: type | None = None
        self.unavailable = ""  # why the figures cannot be complete in this process ("" while they can)
        self._stack_modules: StackModules | None = None
        self._wrapped: set[type] = set()  # cache and layer classes whose methods report to the accounts
        self._growing: tuple[type, ...] = ()  # the cache module's GROWING_LAYERS
        self._layer_base: type | None = None
        self.follows_peaks = False  # set by `install`
        self._on_release: Callable[[Entry], None] = self._forget
        self.accounts = Accounts(self.live, self._charge, self._wrapped, self.layer_seen)

    def _released(self, entry: Entry) -> None:
        try:
            self.accounts.released(entry)
        except Exception as exc:
            _peak_failed(exc)
        self._forget(entry)

    def _forget(self, entry: Entry) -> None:
        if self.live.get(entry.cache_id) is entry:
            del self.live[entry.cache_id]

    def _charge(self, entry: Entry, pointer: int) -> str:
        """The owner a new storage of `entry`'s cache is charged to; its first storage settles a candidate."""
        if entry.candidate is not None and entry.owner is not None:
            self._decide(entry, first_tensor(entry.state, pointer))
        return UNATTRIBUTED_OWNER if entry.owner is None else entry.owner  # as the sampler says before `attach`

    def _decide(self, entry: Entry, tensor: Any) -> None:
        """Charge `entry` to its candidate (the declaring ancestor) if `tensor`, its first, has a declared shape."""
        candidate, entry.candidate = entry.candidate, None
        model, shape = self.model, _shape(entry.state, tensor)
        if candidate is not None and shape is not None and model is not None and model.declares(candidate, shape):
            entry.owner = candidate

    def settle_candidates(self) -> None:
        """Where the high-water mark is not followed (its reads settle them): decide each cache still waiting for its
        first K/V tensor by that tensor, before a sample charges it."""
        for entry in self.entries():
            if entry.candidate is not None and entry.owner is not None:
                tensor = first_tensor(entry.state, None)
                if tensor is not None:
                    self._decide(entry, tensor)

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
        key = entry.cache_id = id(cache)
        entry.state = getattr(cache, "__dict__", None)
        entry.ptrs, entry.tally, entry.candidate = _NOTHING, None, None
        cls = type(cache)
        if self.follows_peaks and cls not in self._wrapped:
            self._wrap(cls)
        model = self.model
        if model is not None:
            entry.owner, entry.candidate = self._owner_at(model, frame)
            entry.pending = ()
        else:
            entry.owner = None
            entry.pending = self._modules_on_stack(frame)
        self.live[key] = entry
        if (
            self.follows_peaks and frame is not None and frame.f_code in _COPYING
        ):  # its contents arrive after `__new__`, unannounced
            self.accounts.dirty.add(key)
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
        if self.follows_peaks:
            self.accounts.rebuild(entries)

    def _model_released(self, root: ModuleRef) -> None:
        if self.model is not None and self.model.root is root:
            self.model = None

    # -- installation ---------------------------------------------------------------------------------------------

    def install(self, cache_base: type, module_type: type[Any], follow_peaks: bool) -> bool:
        """Track every instance of `cache_base` and its subclasses from now on, and (`follow_peaks`) what their
        layers hold as it changes; False when that cannot work."""
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
        self.follows_peaks = follow_peaks
        self._on_release = self._released if follow_peaks else self._forget
        _Contents.accounts = self.accounts if follow_peaks else None
        _Contents.is_compiling = staticmethod(_compiling_test())
        self.installed_on = cache_base
        if not follow_peaks:
            return True
        module = sys.modules.get(cache_base.__module__)
        growing = (getattr(module, name, None) for name in GROWING_LAYERS)
        self._growing = tuple(cls for cls in growing if isinstance(cls, type))
        layer_base = getattr(module, LAYER_BASE, None)
        self._layer_base = layer_base if isinstance(layer_base, type) else None
        for base in (cache_base, self._layer_base) if self._layer_base is not None else (cache_base,):
            pending = [base]
            while pending:  # the classes defined by now; later cache classes as their first instance is tracked
                cls = pending.pop()
                self._wrap(cls)
                pending.extend(cls.__subclasses__())
        return True

    def _wrap(self, cls: type) -> None:
        """Report `cls`'s own methods that change what it holds (and its bases') to the accounts: a cache class's
        update marks it, its reshaping methods and a non-growing layer class's update catch up before they run."""
        cache_base = self.installed_on
        if cache_base is None or not self.follows_peaks:
            return
        is_cache = issubclass(cls, cache_base)
        base = cache_base if is_cache else self._layer_base
        for klass in cls.__mro__:
            if klass in self._wrapped or base is None or not issubclass(klass, base):
                continue
            self._wrapped.add(klass)
            for name in (UPDATE_METHOD, *RESHAPING_METHODS) if is_cache else (UPDATE_METHOD,):
                method = vars(klass).get(name)
                if not callable(method) or hasattr(method, PATCHED_MARK) or klass in self._growing:
                    continue
                if is_cache:
                    hook = _marking(method) if name == UPDATE_METHOD else _falling(method, marks=True)
                else:
                    hook = _falling(method, marks=False)
                setattr(klass, name, hook)

    def layer_seen(self, cls: type) -> None:
        """A layer class first met in a read (defined after the install): its update is followed from now on."""
        if cls not in self._wrapped:
            self._wrap(cls)

    def detach(self) -> None:
        """Stop tracking into this registry (tests, benchmarks). The content hooks go; the `__new__` stays: CPython
        cannot give a class back the `object.__new__` it inherited once it has had its own (deleting it leaves a slot
        that refuses arguments)."""
        cache_base, self.installed_on = self.installed_on, None
        own_new = None if cache_base is None else cache_base.__dict__.get("__new__")
        tracker = getattr(getattr(own_new, "__func__", own_new), PATCHED_MARK, None)
        if isinstance(tracker, _Tracker) and tracker.registry is self:
            tracker.registry = _Contents.accounts = None
            for klass in self._wrapped:
                for name, method in list(vars(klass).items()):
                    original = getattr(method, PATCHED_MARK, None)
                    if name in (UPDATE_METHOD, *RESHAPING_METHODS) and original is not None:
                        setattr(klass, name, original)
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

    accounts: Accounts | None = None  # the installed registry's; None once detached
    is_compiling: Callable[[], bool] = staticmethod(lambda: False)


def _marking(method: Callable[..., Any]) -> Callable[..., Any]:
    """A cache's `update`, then the cache marked: what it holds may have grown (read at the next fall or sample).
    Steps aside while dynamo traces (as `__new__` does: what compiled code holds is seen at the next sample)."""

    @functools.wraps(method)
    def marking(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        accounts = _Contents.accounts
        if accounts is not None and not _Contents.is_compiling():
            accounts.dirty.add(id(self))
        return result

    setattr(marking, PATCHED_MARK, method)
    return marking


def _falling(method: Callable[..., Any], marks: bool) -> Callable[..., Any]:
    """A method after which what a cache (or a layer's cache) holds may be less: the marked caches are read first,
    so the instant before it is counted; a cache's own method then marks it (its new contents are read lazily)."""

    @functools.wraps(method)
    def falling(self: Any, *args: Any, **kwargs: Any) -> Any:
        accounts = _Contents.accounts
        if accounts is None or _Contents.is_compiling():
            return method(self, *args, **kwargs)
        try:
            accounts.catch_up()
        except Exception as exc:
            _peak_failed(exc)
        result = method(self, *args, **kwargs)
        if marks:
            accounts.dirty.add(id(self))
        return result

    setattr(falling, PATCHED_MARK, method)
    return falling


def _peak_failed(exc: Exception) -> None:
    warn_once("observe:peak", "kv-exporter: the high-water mark cannot follow a cache (%s)", repr(exc))


def _shape(state: dict[str, Any] | None, tensor: Any) -> Shape | None:
    """A cache's shape from its layer list and a K or V tensor shaped [batch, heads, positions, head size]."""
    layers = None if state is None else state.get("layers")
    shape: tuple[int, ...] = tuple(getattr(tensor, "shape", ()))
    if state is None or len(shape) != 4 or not isinstance(layers, list):
        return None
    dtype = str(tensor.dtype).removeprefix("torch.")
    growing = state.get("layer_class_to_replicate") is not None
    return Shape(Geometry(len(layers), int(shape[1]), int(shape[3]), dtype), growing)


def _compiling_test() -> Callable[[], bool]:
    """torch.compiler.is_compiling: True while dynamo traces. The frame walk is not traceable (sys._getframe) and
    would break a fullgraph compile of code that makes a cache. The price: a cache made inside compiled code and
    kept after it goes uncounted (dynamo recreates it at run time with `object.__new__`, past this one)."""
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    test = getattr(compiler, "is_compiling", None)
    return test if callable(test) else lambda: False
