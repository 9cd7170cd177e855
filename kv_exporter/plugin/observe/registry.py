"""Every live transformers cache in this process, from creation to release, held by weak references only.

`install` gives transformers' `Cache` base class a `__new__`: every subclass goes through it, and so does
`copy.deepcopy` (which creates the copy with `cls.__new__` and never runs `__init__`). It hands each new cache to the
C tracker (`_tracker.Tracker`), which makes one weak reference per cache (an `Entry`, which also carries the owner),
names its owner from the creating frames and drops it when the cache is released. Where the high-water mark is
followed (KV_EXPORTER_OBSERVE_PEAK, peaks.py) the registry also wraps the methods that change what a cache's layers
hold (`update` and `peaks.RESHAPING_METHODS`, on the base class and on each subclass that defines its own, as it is
first seen): a cache update marks its cache, a reshaping method has the marked caches read first. Where it is not,
nothing but the creation and the release is hooked.

The hooks on the step path are thin Python functions (dynamo traces them, and must be able to step over them while
it compiles) that call the tracker. Everything the tracker cannot decide fast it asks the registry, its `delegate`:
a frame's `self` where several modules share one method, the modules on a stack before the model is known, a
declaring ancestor's geometry at a cache's first storage, a class first seen, a failure to report.
"""

from __future__ import annotations

import copyreg
import functools
import inspect
import sys
from collections.abc import Callable, Collection, Mapping
from types import FrameType
from typing import Any

from kv_exporter.observation import UNATTRIBUTED_OWNER
from kv_exporter.plugin.observe.owners import Attribution, Geometry, ModelMap, ModuleRef, Shape, Site, StackModules
from kv_exporter.plugin.observe.peaks import GROWING_LAYERS, RESHAPING_METHODS, UPDATE_METHOD, first_tensor
from kv_exporter.plugin.oncelog import warn_once

try:
    from kv_exporter.plugin.observe._tracker import Entry, Tracker
except ImportError as exc:  # built without a C compiler: observation says so, the hook works on
    Entry = Tracker = None  # type: ignore[assignment,misc]
    _NOT_BUILT = f"kv-exporter's cache tracker (a C extension) is not built for this Python ({exc})"
else:
    _NOT_BUILT = ""

__all__ = ["PATCHED_MARK", "Entry", "Registry"]

PATCHED_MARK = "__kv_exporter_observe__"
# What `copy.copy`, `copy.deepcopy` and `pickle` create an instance through (its `__new__`'s caller).
_COPYING = tuple(getattr(copyreg, name).__code__ for name in ("__newobj__", "__newobj_ex__"))
LAYER_BASE = "CacheLayerMixin"  # the cache module's layer base class (transformers 4.56 and later)


class Registry:
    def __init__(self) -> None:
        self.model: ModelMap | None = None
        self.installed_on: type | None = None
        self.unavailable = ""  # why the figures cannot be complete in this process ("" while they can)
        self._stack_modules: StackModules | None = None
        self._wrapped: set[type] = set()  # cache and layer classes seen (and their methods wrapped, where followed)
        self._growing: tuple[type, ...] = ()  # the cache module's GROWING_LAYERS
        self._layer_base: type | None = None
        self.tracker = None if Tracker is None else Tracker(self, UNATTRIBUTED_OWNER, self._wrapped, _COPYING)

    @property
    def follows_peaks(self) -> bool:
        """Whether the high-water mark is followed (set by `install`, kept by the tracker)."""
        return self.tracker is not None and self.tracker.follows_peaks

    def entries(self) -> list[Entry]:
        """A snapshot of the live entries, in creation order."""
        return [] if self.tracker is None else self.tracker.entries()

    def take_peaks(self) -> dict[str, int]:
        """owner -> the most it held since the last call (reading a cache settles which owner it is)."""
        return {} if self.tracker is None else self.tracker.take_peaks()

    def settle_candidates(self) -> None:
        """Where the high-water mark is not followed (its reads settle them): decide each cache still waiting for its
        first K/V tensor by that tensor, before a sample charges it."""
        for entry in self.entries():
            if entry.candidate is not None and entry.owner is not None:
                tensor = first_tensor(entry.state, None)
                if tensor is not None:
                    self._decide(entry, tensor)

    def mark_unavailable(self, key: str, reason: str) -> None:
        warn_once(f"observe:{key}", "kv-exporter: cache observation unavailable: %s", reason)
        if not self.unavailable:
            self.unavailable = reason

    # -- the tracker's delegate (called from C where its fast path cannot decide) ----------------------------------

    def owner_of_shared(self, site: Site, frame: FrameType) -> Attribution | None:
        """The attribution of `frame`, running code several modules share, by its `self`; None: not a module's."""
        model = self.model
        return None if model is None else model.shared_owner(site, frame)

    def modules_on_stack(self, frame: FrameType | None) -> tuple[ModuleRef, ...]:
        """Before the model is known: the modules on a new cache's creating stack, named when it is attached."""
        if self._stack_modules is None:
            return ()
        try:
            return self._stack_modules.on_stack(frame)
        except Exception as exc:  # the cache is counted: it will be unattributed
            warn_once("observe:stack", "kv-exporter: cannot read a cache's creating stack (%s)", repr(exc))
            return ()

    def charge(self, entry: Entry, pointer: int) -> str:
        """A cache's first storage, at `pointer`, settles its candidate: the owner its storage is charged to."""
        self._decide(entry, first_tensor(entry.state, pointer))
        return UNATTRIBUTED_OWNER if entry.owner is None else entry.owner

    def class_seen(self, cls: type) -> None:
        """A cache or layer class first met (defined after the install): its methods are followed from now on."""
        self._wrap(cls)
        self._wrapped.add(cls)

    def settle(self, entry: Entry) -> None:
        """A cache registered while `attach` ran: named now."""
        if self.model is not None:
            self._settle(entry, self.model)

    def failed(self, where: str, exc: BaseException) -> None:
        warn_once(f"observe:{where}", "kv-exporter: the high-water mark cannot follow a cache (%s)", repr(exc))

    def track_failed(self, cache: object, exc: Exception) -> None:
        name = type(cache).__qualname__
        if isinstance(exc, TypeError) and "weak reference" in str(exc):
            self.mark_unavailable(f"weakref:{name}", f"{name} cannot be weakly referenced, so its caches go uncounted")
        else:
            self.mark_unavailable("track", f"tracking a {name} failed ({exc!r})")

    def _decide(self, entry: Entry, tensor: Any) -> None:
        """Charge `entry` to its candidate (the declaring ancestor) if `tensor`, its first, has a declared shape."""
        candidate, entry.candidate = entry.candidate, None
        model, shape = self.model, _shape(entry.state, tensor)
        if candidate is not None and shape is not None and model is not None and model.declares(candidate, shape):
            entry.owner = candidate

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
        if self.tracker is None:
            return
        self.tracker.set_sites(self.model.sites)
        for entry in self.entries():
            if entry.owner is None:
                self._settle(entry, self.model)
        if self.follows_peaks:
            self.tracker.rebuild()

    def _model_released(self, root: ModuleRef) -> None:
        if self.model is not None and self.model.root is root:
            self.model = None
            if self.tracker is not None:
                self.tracker.set_sites(None)

    # -- installation ---------------------------------------------------------------------------------------------

    def install(self, cache_base: type, module_type: type[Any], follow_peaks: bool) -> bool:
        """Track every instance of `cache_base` and its subclasses from now on, and (`follow_peaks`) what their
        layers hold as it changes; False when that cannot work."""
        tracker = self.tracker
        if tracker is None:
            self.mark_unavailable("not-built", _NOT_BUILT)
            return False
        if cache_base.__weakrefoffset__ == 0:
            name = cache_base.__qualname__
            self.mark_unavailable(f"weakref:{name}", f"{name} cannot be weakly referenced; nothing is tracked")
            return False
        self._stack_modules = StackModules(module_type)
        own_new = cache_base.__dict__.get("__new__")
        if not hasattr(getattr(own_new, "__func__", own_new), PATCHED_MARK):
            cache_base.__new__ = staticmethod(_tracking_new(cache_base, own_new))  # type: ignore[method-assign]
        tracker.follows_peaks = follow_peaks
        _Hooks.registry = self
        _Hooks.track = tracker.track
        _Hooks.mark = tracker.mark if follow_peaks else None
        _Hooks.catch_up = tracker.catch_up if follow_peaks else None
        _Hooks.is_compiling = staticmethod(_compiling_test())
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
        """Report `cls`'s own methods that change what it holds (and its bases') to the tracker: a cache class's
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

    def detach(self) -> None:
        """Stop tracking into this registry (tests, benchmarks). The content hooks go; the `__new__` stays (tracking
        nowhere): CPython cannot give a class back the `object.__new__` it inherited once it has had its own (deleting
        it leaves a slot that refuses arguments)."""
        self.installed_on = None
        if _Hooks.registry is self:
            _Hooks.registry = _Hooks.track = _Hooks.mark = _Hooks.catch_up = None
            for klass in self._wrapped:
                for name, method in list(vars(klass).items()):
                    original = getattr(method, PATCHED_MARK, None)
                    if name in (UPDATE_METHOD, *RESHAPING_METHODS) and original is not None:
                        setattr(klass, name, original)
        self._wrapped.clear()


class _Hooks:
    """Where the hooks on the step path report: class state, not closure cells (dynamo wraps a traced function's
    cells when it inlines it, and cannot wrap a tracker; state it never loads while tracing costs nothing). None:
    not tracking (detached, or that part not followed)."""

    registry: Registry | None = None
    track: Callable[[object], None] | None = None
    mark: Callable[[object], None] | None = None
    catch_up: Callable[[], None] | None = None
    is_compiling: Callable[[], bool] = staticmethod(lambda: False)


def _tracking_new(cache_base: type[Any], own_new: Any) -> Any:
    """The `__new__` to put on `cache_base`: create the instance as before, then track it, never raising."""
    original = getattr(own_new, "__func__", own_new)  # a `__new__` the class defines itself, else None
    object_new = object.__new__

    def __new__(cls: type[Any], *args: Any, **kwargs: Any) -> Any:
        if original is not None:
            instance = original(cls, *args, **kwargs)
        else:
            upstream = super(cache_base, cls).__new__
            # object.__new__ refuses arguments once a class overrides __new__; __init__ takes them.
            instance = object_new(cls) if upstream is object_new else upstream(cls, *args, **kwargs)
        track = _Hooks.track
        if track is not None and not _Hooks.is_compiling():
            try:
                track(instance)  # the tracker reads this frame's caller: the code that made the cache
            except Exception as exc:
                registry = _Hooks.registry
                if registry is not None:
                    registry.track_failed(instance, exc)
        return instance

    setattr(__new__, PATCHED_MARK, True)
    return __new__


def _marking(method: Callable[..., Any]) -> Callable[..., Any]:
    """A cache's `update`, then the cache marked: what it holds may have grown (read at the next fall or sample).
    Steps aside while dynamo traces (as `__new__` does: what compiled code holds is seen at the next sample).

    It runs on every cache update, so it takes `method`'s own parameters and calls it without packing them where it
    can (`_forwarding`): a `*args, **kwargs` wrapper cost ~50% more per call (docs/benchmarks.md, section 9)."""
    body = """
        mark = _Hooks.mark
        if mark is not None and not _Hooks.is_compiling():
            mark(self)
        return result"""
    marking = _forwarding(method, body, {"_Hooks": _Hooks})
    setattr(marking, PATCHED_MARK, method)
    return marking


def _forwarding(method: Callable[..., Any], body: str, names: dict[str, Any]) -> Callable[..., Any]:
    """A function with `method`'s parameters (and defaults) that sets `result` to `method` called with them, then
    runs `body`; its first parameter is named `self` there. Where `method`'s signature cannot be read, or its first
    parameter is not positional, a `*args, **kwargs` one."""
    try:
        parameters = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    first = parameters[0] if parameters else None
    taken = {*names, "result"} | {name for name in body.split() if name.isidentifier()}
    if (
        first is None
        or first.kind not in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD)
        or any(p.name in taken or p.name.startswith("_kvx_") for p in parameters[1:])
    ):
        parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)]
        parameters += [inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)]
        parameters += [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    namespace: dict[str, Any] = {**names, "_kvx_method": method}
    declared, passed, spread = [], [], []
    for index, parameter in enumerate(parameters):
        name = "self" if index == 0 else parameter.name
        if parameter.default is not parameter.empty:
            namespace[f"_kvx_default_{index}"] = parameter.default
        default = "" if parameter.default is parameter.empty else f"=_kvx_default_{index}"
        if parameter.kind is parameter.VAR_POSITIONAL:
            declared.append(f"*{name}")
            spread.append(f"*{name}")
        elif parameter.kind is parameter.VAR_KEYWORD:
            declared.append(f"**{name}")
            spread.append(f"**{name}")
        elif parameter.kind is parameter.KEYWORD_ONLY:
            if not any(text.startswith("*") for text in declared):
                declared.append("*")
            declared.append(name + default)
            passed.append(f"{name}={name}")
        else:
            declared.append(name + default)
            passed.append(name)
        if parameter.kind is parameter.POSITIONAL_ONLY and (
            index + 1 == len(parameters) or parameters[index + 1].kind is not parameter.POSITIONAL_ONLY
        ):
            declared.append("/")
    packed = [name.lstrip("*") for name in spread]
    call = f"_kvx_method({', '.join(passed + spread)})"
    plain = f"_kvx_method({', '.join(passed)})"
    # Empty `*args` and `**kwargs` (the usual case) are not spread again: a plain call is cheaper.
    result = f"{call} if {' or '.join(packed)} else {plain}" if packed else call
    source = f"def {method.__name__}({', '.join(declared)}):\n        result = {result}{body}\n"
    exec(compile(source, f"<kv-exporter wrapper of {method.__qualname__}>", "exec"), namespace)
    function: Callable[..., Any] = functools.wraps(method)(namespace[method.__name__])
    return function


def _falling(method: Callable[..., Any], marks: bool) -> Callable[..., Any]:
    """A method after which what a cache (or a layer's cache) holds may be less: the marked caches are read first,
    so the instant before it is counted; a cache's own method then marks it (its new contents are read lazily)."""

    @functools.wraps(method)
    def falling(self: Any, *args: Any, **kwargs: Any) -> Any:
        catch_up, mark = _Hooks.catch_up, _Hooks.mark
        if catch_up is None or mark is None or _Hooks.is_compiling():
            return method(self, *args, **kwargs)
        catch_up()  # never raises: the tracker reports its failures
        result = method(self, *args, **kwargs)
        if marks:
            mark(self)
        return result

    setattr(falling, PATCHED_MARK, method)
    return falling


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
    """torch.compiler.is_dynamo_compiling (else is_compiling, before torch 2.3): True while dynamo traces, which
    cannot trace the tracker (it reads the interpreter's frames) and would break a fullgraph compile of code that
    makes a cache. The dynamo-only test is one Python call, is_compiling three: it runs on every cache update. The
    price: a cache made inside compiled code and kept after it goes uncounted (dynamo recreates it at run time with
    `object.__new__`, past this one)."""
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    test = getattr(compiler, "is_dynamo_compiling", None) or getattr(compiler, "is_compiling", None)
    return test if callable(test) else lambda: False
