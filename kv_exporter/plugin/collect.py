"""Collect the declarations of a loaded model: with vllm-omni's own collector where it can be had safely.

`import vllm_omni` runs a package `__init__` that patches vLLM internals of its own version (against another
vLLM it fails half-way), so the package is never imported here. Where a vllm-omni process has already
imported it, its protocol module is imported normally. Otherwise, where the wheel is merely installed, the
protocol module is loaded by file path -- only after checking that it imports nothing beyond torch,
`vllm.logger` and the standard library. Anything else falls back to kv_exporter's own collector.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from kv_exporter.manifest import CollectorName, Declaration
from kv_exporter.plugin.oncelog import warn_once
from kv_exporter.plugin.settings import COLLECTOR_AUTO
from kv_exporter.protocol import collect_model_local_kv_specs

UPSTREAM_PACKAGE = "vllm_omni"
UPSTREAM_MODULE = "vllm_omni.model_executor.models.model_local_kv"
UPSTREAM_RELATIVE_PATH = Path("model_executor", "models", "model_local_kv.py")
# The private name the file-path copy lives under: never the real dotted name, which would make a later
# `import vllm_omni...` find a half-registered package.
PRIVATE_MODULE = "kv_exporter.plugin._upstream_model_local_kv"
SAFE_IMPORT_ROOTS = frozenset(
    {"__future__", "abc", "collections", "dataclasses", "enum", "functools", "logging", "math", "typing", "torch"}
)
SAFE_IMPORT_MODULES = frozenset({"vllm.logger"})

COLLECTOR_UPSTREAM: CollectorName = "vllm_omni"
COLLECTOR_OURS: CollectorName = "kv_exporter"

Collect = Callable[[object], list[tuple[str, Any]]]

_upstream: tuple[Collect | None] | None = None  # cached lookup: (function or None,)


def imports_are_safe(source: str) -> bool:
    """True when every import in `source` is absolute and in the allow-list (a static check, nothing runs)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level or node.module is None:
                return False
            names = [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] not in SAFE_IMPORT_ROOTS and name not in SAFE_IMPORT_MODULES:
                return False
    return True


def upstream_module_path() -> Path | None:
    """Where the installed wheel keeps the protocol module, found without executing the package."""
    spec = importlib.util.find_spec(UPSTREAM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location, UPSTREAM_RELATIVE_PATH)
        if candidate.is_file():
            return candidate
    return None


def load_by_path(path: Path) -> ModuleType | None:
    if not imports_are_safe(path.read_text(encoding="utf-8")):
        warn_once("upstream-unsafe", "kv-exporter: %s imports more than expected; not loading it", path)
        return None
    spec = importlib.util.spec_from_file_location(PRIVATE_MODULE, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses look their module up in sys.modules while being defined.
    sys.modules[PRIVATE_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[PRIVATE_MODULE]
        raise
    return module


def _find_upstream() -> Collect | None:
    if UPSTREAM_PACKAGE in sys.modules:
        module: ModuleType | None = importlib.import_module(UPSTREAM_MODULE)
    else:
        path = upstream_module_path()
        module = load_by_path(path) if path is not None else None
    function = getattr(module, "collect_model_local_kv_specs", None)
    return function if callable(function) else None


def upstream_collector() -> Collect | None:
    """vllm-omni's `collect_model_local_kv_specs`, or None; looked up once per process."""
    global _upstream
    if _upstream is None:
        try:
            _upstream = (_find_upstream(),)
        except Exception as exc:
            warn_once("upstream", "kv-exporter: vllm-omni's collector unavailable (%r); using kv_exporter's", exc)
            _upstream = (None,)
    return _upstream[0]


def collect(model: object, preference: str = COLLECTOR_AUTO) -> tuple[CollectorName, list[tuple[str, Any]]]:
    """(collector name, [(owner path, spec)]) for `model`; the raw specs, not yet converted."""
    upstream = None if preference == COLLECTOR_OURS else upstream_collector()
    if upstream is not None:
        return COLLECTOR_UPSTREAM, list(upstream(model))
    if preference == COLLECTOR_UPSTREAM:
        warn_once("upstream-forced", "kv-exporter: vllm-omni's collector requested but unavailable; using ours")
    return COLLECTOR_OURS, list(collect_model_local_kv_specs(model))


def to_declarations(pairs: list[tuple[str, Any]]) -> tuple[Declaration, ...]:
    """Convert each spec; skip (and log) one that cannot be, and any repeat of an (owner, name) pair."""
    declarations: list[Declaration] = []
    seen: set[tuple[str, str]] = set()
    for owner, spec in pairs:
        try:
            declaration = Declaration.from_spec(owner, spec)
        except Exception as exc:
            warn_once(f"spec:{owner}", "kv-exporter: skipping a declaration of %r: %r", owner or "<root>", exc)
            continue
        key = (declaration.owner, declaration.name)
        if key in seen:
            warn_once(f"dup:{key}", "kv-exporter: %r declares %r twice; keeping the first", *key)
            continue
        seen.add(key)
        declarations.append(declaration)
    return tuple(declarations)
