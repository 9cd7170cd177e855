"""Where the hook attaches, and how it finds the outermost call.

Two methods are wrapped on the classes, nothing else: a model runner's `load_model` (publish phase "load") and a
worker's `compile_or_warm_up_model` (publish phase "warmup", when declarations that read live state are complete).
The per-step methods are never wrapped here: the step record (`steps`) wraps one runner instance's `execute_model`
at publish, in C, so serving pays ~0.1 us a step.

Subclasses override `load_model` and call `super().load_model()` (vllm-omni's runners do, then keep setting
up), so every class in the instance's MRO that defines the method is wrapped and a per-instance depth counter
fires the callback only when the outermost call returns. The MRO is completed from the base classes'
`__init__`, so subclasses defined anywhere (vllm-omni's runner family, a test's runner) are covered before their
first `load_model`, without importing them here.

The runner modules are patched when they are imported (a post-import hook), so the API server process, which
never loads a model, pays one dictionary lookup per import and imports nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kv_exporter.plugin.oncelog import warn_once

WRAPPED_MARK = "__kv_exporter_hook__"

Callback = Callable[[Any], None]


@dataclass(frozen=True)
class MethodHook:
    """Wrap `method` on `classes` of `module` (and on their subclasses, at instance creation)."""

    module: str
    classes: tuple[str, ...]
    method: str
    after_outermost: Callback


# (instance id, method) -> depth of nested calls in progress. Entries exist only during a call.
_depth: dict[tuple[int, str], int] = {}


def _wrap(original: Callable[..., Any], method: str, after: Callback) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        key = (id(self), method)
        _depth[key] = _depth.get(key, 0) + 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            remaining = _depth[key] - 1
            if remaining:
                _depth[key] = remaining
            else:
                del _depth[key]
        if not remaining:
            _run_guarded(after, self)
        return result

    setattr(wrapper, WRAPPED_MARK, True)
    return wrapper


def _run_guarded(after: Callback, instance: object) -> None:
    try:
        after(instance)
    except Exception as exc:  # the callbacks guard themselves; this is the last line of defence
        warn_once("callback", "kv-exporter: hook callback failed on %s: %r", type(instance).__name__, exc)


def is_wrapped(function: object) -> bool:
    return bool(getattr(function, WRAPPED_MARK, False))


def wrap_class_method(cls: type, method: str, after: Callback) -> bool:
    """Wrap `cls.method` if `cls` itself defines it (not inherited) and it is not wrapped yet."""
    original = cls.__dict__.get(method)
    if original is None or isinstance(original, (staticmethod, classmethod, property)) or not callable(original):
        return False
    if is_wrapped(original):
        return False
    setattr(cls, method, _wrap(original, method, after))
    return True


def wrap_mro(cls: type, method: str, after: Callback) -> None:
    """Wrap every definition of `method` along `cls`'s MRO (idempotent)."""
    for klass in cls.__mro__:
        if method in klass.__dict__:
            wrap_class_method(klass, method, after)


# On a wrapped `__init__`: the (method, callback) pairs whose MRO it completes (several hooks may share one class).
_INIT_METHODS = "__kv_exporter_methods__"


def _wrap_init(cls: type, method: str, after: Callback) -> None:
    """Make `cls.__init__` complete the MRO wrapping for the concrete class before anything else runs."""
    original = cls.__dict__.get("__init__")
    if original is None:
        return
    if is_wrapped(original):
        listed = getattr(original, _INIT_METHODS, None)
        if listed is not None and (method, after) not in listed:
            listed.append((method, after))
        return
    methods: list[tuple[str, Callback]] = [(method, after)]

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for name, callback in methods:
            try:
                wrap_mro(type(self), name, callback)
            except Exception as exc:  # never in the way of constructing the runner
                warn_once(f"wrap:{name}", "kv-exporter: could not hook %s.%s: %r", type(self).__name__, name, exc)
        original(self, *args, **kwargs)

    setattr(__init__, WRAPPED_MARK, True)
    setattr(__init__, _INIT_METHODS, methods)
    cls.__init__ = __init__  # type: ignore[misc]


def install_on_class(cls: type, hook: MethodHook) -> None:
    wrap_mro(cls, hook.method, hook.after_outermost)
    _wrap_init(cls, hook.method, hook.after_outermost)


def install_on_module(module: ModuleType, hooks: Sequence[MethodHook]) -> None:
    for hook in hooks:
        for name in hook.classes:
            cls = getattr(module, name, None)
            if isinstance(cls, type):
                try:
                    install_on_class(cls, hook)
                except Exception as exc:
                    warn_once(
                        f"install:{module.__name__}.{name}",
                        "kv-exporter: cannot hook %s.%s: %r",
                        module.__name__,
                        name,
                        exc,
                    )


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the patch. The module keeps its real loader (inspect and torch read it)."""

    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        try:
            self._patch(module)
        except Exception as exc:  # a failed patch must not fail vLLM's own import
            warn_once(f"patch:{module.__name__}", "kv-exporter: cannot patch %s: %r", module.__name__, exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class PostImportHook(importlib.abc.MetaPathFinder):
    """Patches named modules right after they are first executed."""

    def __init__(self, patches: Mapping[str, Callable[[ModuleType], None]]) -> None:
        self._patches = dict(patches)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self._patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            spec.loader = _PatchingLoader(loader, patch)
        return spec


def install_post_import(patches: Mapping[str, Callable[[ModuleType], None]]) -> None:
    """Patch what is already imported now; the rest when it is imported. Idempotent per module name."""
    pending: dict[str, Callable[[ModuleType], None]] = {}
    for name, patch in patches.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            pending[name] = patch
    if pending:
        sys.meta_path.insert(0, PostImportHook(pending))
