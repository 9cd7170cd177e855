"""Every live transformers cache in this process, from creation to release, held by weak references only.

`install` gives transformers' `Cache` base class a `__new__`: every subclass goes through it, and so does
`copy.deepcopy` (which creates the copy with `cls.__new__` and never runs `__init__`). It hands each new cache to the
C tracker (`_tracker.Tracker`, the ledger), which makes one weak reference per cache (an `Entry`, which also carries
the owner), names its owner from the creating frames and drops it when the cache is released. It also gives every
cache class a finalizer (`__del__`, wrapping a class's own): the instant a cache goes, while it is still whole, the
tracker reads what it held last; nothing of the cache is ever kept alive for that.

Where the high-water mark is followed (KV_EXPORTER_OBSERVE_PEAK, peaks.py) the registry also wraps the methods that
change what a cache's layers hold (`update` and `peaks.RESHAPING_METHODS`, on the base class and on each subclass that
defines its own, as it is first seen): a cache update marks its cache, a reshaping method has the marked caches read
first. Where it is not, nothing but the creation and the release is hooked.

A wrapper never changes what a call means (wrappers.py). Only plain functions are wrapped (a
`staticmethod`, `classmethod`, `functools.partial`, callable object or builtin binds differently, so a function in its
place would change the call): a class holding one of those where a wrapper would go is not followed, and its caches are
counted as such (`UnreadableReason.NOT_FOLLOWED`), costing that class only.

The hooks (wrappers.py) call the tracker. Everything the tracker cannot decide fast it asks the registry, its
`delegate`: a frame's `self` where several modules share one method, the modules on a stack before the model is
known, a declaring ancestor's geometry at a cache's first storage, a class first seen.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Collection, Mapping
from types import FrameType, FunctionType
from typing import Any

from kv_exporter.observation import UNATTRIBUTED_OWNER, UnreadableReason
from kv_exporter.plugin.observe.owners import Attribution, Geometry, ModelMap, ModuleRef, Shape, Site, StackModules
from kv_exporter.plugin.observe.peaks import GROWING_LAYERS, RESHAPING_METHODS, UPDATE_METHOD
from kv_exporter.plugin.oncelog import warn_once

try:
    from kv_exporter.plugin.observe import wrappers
    from kv_exporter.plugin.observe._tracker import Entry, Tracker
except ImportError as exc:  # built without a C compiler: observation says so, the hook works on
    Entry = Tracker = wrappers = None  # type: ignore[assignment,misc]
    _NOT_BUILT = f"kv-exporter's cache tracker (a C extension) is not built for this Python ({exc})"
else:
    _NOT_BUILT = ""

__all__ = ["Entry", "Figures", "Registry"]

FINALIZER = "__del__"
LAYER_BASE = "CacheLayerMixin"  # the cache module's layer base class (transformers 4.56 and later)
# The tracker's reason codes, from 1 (0: readable), in _tracker.c's order.
REASON_CODES = (
    UnreadableReason.NO_LAYERS,
    UnreadableReason.LAYERS_RAISED,
    UnreadableReason.NOT_A_TENSOR,
    UnreadableReason.NO_STORAGE,
    UnreadableReason.NOT_FOLLOWED,
)
# A sample asks the model's own thread to read the caches that changed, at its next cache update (no thread then
# waits for the GIL for it). It waits while updates keep coming, at most SERVE_WAIT_S; once none came for
# SERVE_QUIET_S the model is between steps or idle, and the sampler reads them itself.
SERVE_WAIT_S = 0.25
SERVE_QUIET_S = 0.006
SERVE_POLL_S = 0.002
# Caches re-read at each sample whether or not a hooked method announced a change (code assigning a layer's tensors
# itself, a compiled region's replayed mutations): round robin, so each is re-read within live caches / AUDIT_CACHES
# samples. A 28-layer cache takes ~25 us to read here: 8 keep a sample's own work near 0.2 ms.
AUDIT_CACHES = 8

# owner -> (bytes, peak, caches, stored tensors, state tensors), and (owner, reason) -> objects left out.
Figures = tuple[dict[str, tuple[int, int, int, int, int]], dict[tuple[str, UnreadableReason], int]]


class Registry:
    def __init__(self) -> None:
        self.model: ModelMap | None = None
        self.installed_on: type | None = None
        self.unavailable = ""  # why the figures cannot be complete in this process ("" while they can)
        self.tracker: Any = None  # made by `install`, when torch is there
        self._stack_modules: StackModules | None = None
        self._wrapped: set[type] = set()  # cache and layer classes seen (and their methods wrapped)
        self._unfollowed: set[type] = set()  # cache classes whose changes cannot be followed
        self._exotic: set[type] = set()  # classes defining a hooked method that is no plain function
        self._growing: tuple[type, ...] = ()  # the cache module's GROWING_LAYERS
        self._layer_base: type | None = None
        self._follows = False

    @property
    def follows_peaks(self) -> bool:
        """Whether the high-water mark is followed (set by `install`)."""
        return self.tracker is not None and self._follows

    def entries(self) -> list[Entry]:
        """A snapshot of the live entries, in creation order."""
        return [] if self.tracker is None else self.tracker.entries()

    def sample(self, pause: Callable[[], None], slice_s: float) -> Figures:
        """Every owner's figures now in every form, and the most since the last sample (then the next interval
        starts)."""
        tracker = self.tracker
        if tracker is None:
            return {}, {}
        if self.follows_peaks:
            tracker.audit(AUDIT_CACHES)
            _served(tracker, tracker.request())
        else:
            tracker.audit(-1)  # only creations and releases are hooked: every cache is read now
        tracker.catch_up(pause, slice_s)  # what no model thread read: the model is idle, or nothing is followed
        count, last = tracker.failures()
        if count:
            warn_once("observe:tracker", "kv-exporter: the cache tracker failed %d time(s), last: %s", count, last)
        owners, unreadable = tracker.take()
        return owners, {(owner, REASON_CODES[code - 1]): n for (owner, code), n in unreadable.items()}

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

    def decide(self, entry: Entry, cache: object, tensor: Any) -> None:
        """A cache's first K/V `tensor` settles its candidate: the declaring ancestor if the shape is declared."""
        candidate, entry.candidate = entry.candidate, None
        model, shape = self.model, _shape(cache, tensor)
        if candidate is not None and shape is not None and model is not None and model.declares(candidate, shape):
            entry.owner = candidate

    def class_seen(self, cls: type) -> None:
        """A cache or layer class first met (defined after the install): hooked from now on."""
        self._hook(cls)

    def settle(self, entry: Entry) -> None:
        """A cache registered while `attach` ran: named now."""
        if self.model is not None:
            self._settle(entry, self.model)

    def track_failed(self, cache: object, exc: Exception) -> None:
        name = type(cache).__qualname__
        if isinstance(exc, TypeError) and "weak reference" in str(exc):
            self.mark_unavailable(f"weakref:{name}", f"{name} cannot be weakly referenced, so its caches go uncounted")
        else:
            self.mark_unavailable("track", f"tracking a {name} failed ({exc!r})")

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
        if Tracker is None:
            self.mark_unavailable("not-built", _NOT_BUILT)
            return False
        if cache_base.__weakrefoffset__ == 0:
            name = cache_base.__qualname__
            self.mark_unavailable(f"weakref:{name}", f"{name} cannot be weakly referenced; nothing is tracked")
            return False
        if self.tracker is None:  # one ledger for the process: a detached registry installed again keeps it
            torch: Any = sys.modules["torch"]
            self.tracker = Tracker(self, UNATTRIBUTED_OWNER, self._wrapped, self._unfollowed, torch.Tensor)
        self.tracker.follows_peaks = self._follows = follow_peaks
        self._stack_modules = StackModules(module_type)
        own_new = cache_base.__dict__.get("__new__")
        if not wrappers.is_hook(getattr(own_new, "__func__", own_new)):
            cache_base.__new__ = staticmethod(wrappers.tracking_new(cache_base, own_new))  # type: ignore[method-assign]
        wrappers.Hooks.report_to(self, self.tracker, follow_peaks)
        self.installed_on = cache_base
        module = sys.modules.get(cache_base.__module__)
        growing = (getattr(module, name, None) for name in GROWING_LAYERS)
        self._growing = tuple(cls for cls in growing if isinstance(cls, type))
        layer_base = getattr(module, LAYER_BASE, None)
        self._layer_base = layer_base if isinstance(layer_base, type) and follow_peaks else None
        for base in (cache_base, self._layer_base):
            pending = [base] if base is not None else []
            while pending:  # the classes defined by now; later ones as their first instance is tracked
                cls = pending.pop()
                self._hook(cls)
                pending.extend(cls.__subclasses__())
        return True

    def _hook(self, cls: type) -> None:
        """Hook `cls` and its bases: every cache class's finalizer; where followed, a cache class's `update` marks
        it, its reshaping methods and a non-growing layer class's `update` catch up before they run. A cache class
        holding a hooked method that is no plain function is not followed."""
        cache_base = self.installed_on
        if cache_base is None:
            return
        is_cache = issubclass(cls, cache_base)
        base = cache_base if is_cache else self._layer_base
        for klass in cls.__mro__:
            if klass in self._wrapped or base is None or not issubclass(klass, base):
                continue
            self._wrapped.add(klass)
            for name in self._hooked_names(is_cache):
                method = vars(klass).get(name)
                growing = name == UPDATE_METHOD and klass in self._growing
                if method is None or wrappers.is_hook(method) or growing:
                    continue
                if not isinstance(method, FunctionType):
                    self._exotic.add(klass)
                    continue
                setattr(klass, name, self._wrapper(name, method, is_cache))
            if klass is cache_base and FINALIZER not in vars(klass):
                setattr(klass, FINALIZER, wrappers.finalizing(None))
        self._wrapped.add(cls)
        if is_cache and any(klass in self._exotic for klass in cls.__mro__):
            self._unfollowed.add(cls)
            warn_once(
                f"observe:unfollowed:{cls.__qualname__}",
                "kv-exporter: %s's methods cannot be followed (one is not a plain function); its caches are counted "
                "as not followed",
                cls.__qualname__,
            )

    def _hooked_names(self, is_cache: bool) -> tuple[str, ...]:
        if not self._follows:
            return (FINALIZER,) if is_cache else ()
        return (UPDATE_METHOD, *RESHAPING_METHODS, FINALIZER) if is_cache else (UPDATE_METHOD,)

    @staticmethod
    def _wrapper(name: str, method: FunctionType, is_cache: bool) -> Callable[..., Any]:
        if name == FINALIZER:
            return wrappers.finalizing(method)
        if not is_cache:
            return wrappers.falling(method, marks=False)
        return wrappers.marking(method) if name == UPDATE_METHOD else wrappers.falling(method, marks=True)

    def step_switch(self) -> Callable[[bool], None]:
        """Turns the step-path hooks off and on between two steps, as the decode benchmarks compare them: off, the hooks
        report nowhere and every wrapped method is its original again (the cache base's own `__new__` and finalizer
        stay, tracking nowhere)."""
        methods = [
            (klass, name, method, wrappers.original_of(method))
            for klass in list(self._wrapped)
            for name, method in list(vars(klass).items())
            if callable(wrappers.original_of(method))
        ]

        def apply(on: bool) -> None:
            wrappers.Hooks.report_to(self if on else None, self.tracker if on else None, self._follows)
            for klass, name, wrapped, original in methods:
                setattr(klass, name, wrapped if on else original)

        return apply

    def detach(self) -> None:
        """Stop tracking into this registry (tests, benchmarks). The content hooks go; the `__new__` and the base
        class's finalizer stay (tracking nowhere): CPython cannot give a class back the `object.__new__` it
        inherited once it has had its own (deleting it leaves a slot that refuses arguments)."""
        self.installed_on = None
        if wrappers is not None and wrappers.Hooks.registry is self:
            wrappers.Hooks.report_to(None, None, False)
            for klass in self._wrapped:
                for name, method in list(vars(klass).items()):
                    original = wrappers.original_of(method)
                    if name in (UPDATE_METHOD, *RESHAPING_METHODS, FINALIZER) and original is not None:
                        setattr(klass, name, original)
        self._wrapped.clear()
        self._unfollowed.clear()


def _served(tracker: Any, asked: int) -> bool:
    """Waits until a model thread has served request `asked`, while cache updates keep coming; whether it was."""
    deadline = time.monotonic() + SERVE_WAIT_S
    marks, quiet_since = tracker.marks, time.monotonic()
    while tracker.served < asked:
        now = time.monotonic()
        if now >= deadline or now - quiet_since >= SERVE_QUIET_S:
            return False
        time.sleep(SERVE_POLL_S)
        if tracker.marks != marks:
            marks, quiet_since = tracker.marks, time.monotonic()
    return True


def _shape(cache: object, tensor: Any) -> Shape | None:
    """A cache's shape from its layer list and a K or V tensor shaped [batch, heads, positions, head size]."""
    state = vars(cache)  # as the tracker reads a cache: its instance dictionary, no property of its class
    layers = state.get("layers")
    shape: tuple[int, ...] = tuple(getattr(tensor, "shape", ()))
    if len(shape) != 4 or not isinstance(layers, list):
        return None
    dtype = str(tensor.dtype).removeprefix("torch.")
    growing = state.get("layer_class_to_replicate") is not None
    return Shape(Geometry(len(layers), int(shape[1]), int(shape[3]), dtype), growing)
