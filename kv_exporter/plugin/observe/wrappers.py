"""The hooks the registry puts on cache and layer classes, and where they report.

A wrapper never changes what a call means: it takes `*args, **kwargs` and hands them on untouched, so the original
accepts and rejects exactly what it would (same exception, same message). The hooks are thin Python functions
(dynamo traces them, and must be able to step over them while it compiles) that call the tracker, with one
exception on the step path: a cache class's `update` is an `UpdateHook` (C), which the interpreter calls for
`cache.update(...)` with the instance unbound; every other access to it binds the Python wrapper (`__get__`), so
introspection, `super()`, a bound method kept for later and dynamo all meet that wrapper, as before.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from sys import _getframe
from types import FrameType
from typing import Any

from kv_exporter.plugin.observe._tracker import UpdateHook, mark_updates_into

PATCHED_MARK = "__kv_exporter_observe__"


class Hooks:
    """Where the hooks report: class state, not closure cells (dynamo wraps a traced function's cells when it inlines
    it, and cannot wrap a tracker; state it never loads while tracing costs nothing). None: not tracking (detached,
    or that part not followed)."""

    registry: Any = None
    track: Callable[[object, FrameType | None], None] | None = None
    release: Callable[[object], None] | None = None
    mark: Callable[[object], None] | None = None
    catch_up: Callable[[], None] | None = None
    is_compiling: Callable[[], bool] = staticmethod(lambda: False)

    @classmethod
    def report_to(cls, registry: Any, tracker: Any, follow_peaks: bool) -> None:
        """From now on the hooks report to `tracker` for `registry` (None: nowhere)."""
        cls.registry = registry
        cls.track = None if tracker is None else tracker.track
        cls.release = None if tracker is None else tracker.release
        cls.mark = tracker.mark if tracker is not None and follow_peaks else None
        cls.catch_up = tracker.catch_up if tracker is not None and follow_peaks else None
        cls.is_compiling = staticmethod(_compiling_test())
        mark_updates_into(tracker if follow_peaks else None)


def _bind(self: UpdateHook, instance: object, owner: type | None = None) -> Any:
    """A cache class's `update` (see the module's docstring) read any way but a call's method load: bound, as a
    function binds, to the Python wrapper."""
    return self.wrapper.__get__(instance, owner)


# Set on the C type itself, after it is made: the method-descriptor flag (a call's method load hands the instance
# unbound) comes only from its spec, and no Python subclass carries it; setting `__get__` fills the slot and leaves
# the flag (docs/decisions/0027-tracker-on-the-limited-api.md).
UpdateHook.__get__ = _bind  # type: ignore[attr-defined]


def is_hook(method: object) -> bool:
    """Whether `method` is one of these hooks."""
    return isinstance(method, UpdateHook) or hasattr(method, PATCHED_MARK)


def original_of(method: object) -> Any:
    """The method a hook stands for (None: `method` is no hook of ours)."""
    if isinstance(method, UpdateHook):
        return method.original
    return getattr(method, PATCHED_MARK, None)


def tracking_new(cache_base: type[Any], own_new: Any) -> Any:
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
        track = Hooks.track
        if track is not None and not Hooks.is_compiling():
            try:
                track(instance, _getframe(1))  # this call's caller: the code that made the cache
            except Exception as exc:
                registry = Hooks.registry
                if registry is not None:
                    registry.track_failed(instance, exc)
        return instance

    setattr(__new__, PATCHED_MARK, True)
    return __new__


def marking(method: Callable[..., Any]) -> Any:
    """A cache's `update`, then the cache marked: what it holds may have grown (read at the next catch-up). Steps
    aside while dynamo traces (as `__new__` does: what compiled code holds is seen at the next sample)."""

    @functools.wraps(method)
    def update(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        mark = Hooks.mark
        if mark is not None and args and not Hooks.is_compiling():
            mark(args[0])
        return result

    setattr(update, PATCHED_MARK, method)
    return UpdateHook(method, update)


def falling(method: Callable[..., Any], marks: bool) -> Callable[..., Any]:
    """A method after which what a cache (or a layer's cache) holds may be less: the marked caches are read first,
    so the instant before it is counted; a cache's own method then marks it (its new contents are read lazily)."""

    @functools.wraps(method)
    def falling(*args: Any, **kwargs: Any) -> Any:
        catch_up, mark = Hooks.catch_up, Hooks.mark
        if catch_up is None or mark is None or Hooks.is_compiling():
            return method(*args, **kwargs)
        catch_up()  # never raises: the tracker counts its failures
        result = method(*args, **kwargs)
        if marks and args:
            mark(args[0])
        return result

    setattr(falling, PATCHED_MARK, method)
    return falling


def finalizing(method: Callable[..., Any] | None) -> Callable[..., Any]:
    """A cache class's finalizer: the tracker reads what the cache held last and lets it go, then the class's own
    `__del__` (if it has one) runs as it would have."""

    def __del__(*args: Any, **kwargs: Any) -> Any:
        release = Hooks.release
        if release is not None and args:
            release(args[0])  # never raises
        return None if method is None else method(*args, **kwargs)

    if method is not None:
        functools.update_wrapper(__del__, method)
    setattr(__del__, PATCHED_MARK, method)
    return __del__


def _compiling_test() -> Callable[[], bool]:
    """torch.compiler.is_dynamo_compiling (else is_compiling, before torch 2.3): True while dynamo traces, which
    cannot trace the tracker (it reads the interpreter's frames) and would break a fullgraph compile of code that
    makes a cache. The dynamo-only test is one Python call, is_compiling three: it runs on every cache update. The
    price: a cache made inside compiled code and kept after it goes uncounted (dynamo recreates it at run time with
    `object.__new__`, past this one)."""
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    test = getattr(compiler, "is_dynamo_compiling", None) or getattr(compiler, "is_compiling", None)
    return test if callable(test) else lambda: False
