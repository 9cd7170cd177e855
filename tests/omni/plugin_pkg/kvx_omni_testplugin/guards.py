"""Import-time guards for the CUDA builds of torchvision and torchaudio in the CPU-only omni test venv.

vllm-omni imports torchvision and torchaudio unconditionally (transformers' image utilities, the OpenAI
audio mixin). The only wheels on PyPI for the torch 2.13 they pair with are CUDA builds: their native
extensions cannot load against torch 2.13.0+cpu (libc10_cuda.so / libtorch_cuda.so are missing), and two
import paths turn that into a hard failure:

* torchvision/_meta_registrations.py registers fake kernels for ``torchvision::nms`` / ``qnms`` with
  ``torch.library.register_fake`` even when the extension did not load:
  ``RuntimeError: operator torchvision::nms does not exist``.
* torchaudio/_extension/utils.py ``_load_lib`` lets the loader's OSError escape:
  ``OSError: Could not load this library: .../torchaudio/lib/_torchaudio.so``.

Both are handled here without editing the installed packages: a meta-path finder wraps the loaders of
exactly those two modules. Nothing else is touched and torch is not imported at interpreter start (this
module is imported from a .pth file that scripts/ensure-omni-env.sh writes into .venv-omni only).

The same finder offers ``after_import`` (a post-import hook), which the platform plugin uses to register
the test pipeline as soon as vllm-omni's pipeline registry exists (see platform.py for why).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any


@contextlib.contextmanager
def _tolerant_register_fake() -> Iterator[None]:
    """Make register_fake a no-op for torchvision operators whose native library did not load."""
    import torch.library

    original = torch.library.register_fake

    def register_fake(op: Any, func: Any = None, /, **kwargs: Any) -> Any:
        def apply(fn: Any) -> Any:
            try:
                return original(op, fn, **kwargs)
            except RuntimeError as exc:
                if isinstance(op, str) and op.startswith("torchvision::") and "does not exist" in str(exc):
                    return fn
                raise

        return apply if func is None else apply(func)

    torch.library.register_fake = register_fake
    try:
        yield
    finally:
        torch.library.register_fake = original


def _guard_torchaudio_load_lib(module: ModuleType) -> None:
    """Treat an extension that is present but cannot load as absent (what a CPU build reports)."""
    original: Callable[[str], bool] = module._load_lib

    def _load_lib(lib: str) -> bool:
        try:
            return original(lib)
        except OSError:
            return False

    module._load_lib = _load_lib


# module name -> (context around its execution, fix-up after it)
_GUARDS: dict[str, tuple[Callable[[], contextlib.AbstractContextManager[None]] | None, Any]] = {
    "torchvision._meta_registrations": (_tolerant_register_fake, None),
    "torchaudio._extension.utils": (None, _guard_torchaudio_load_lib),
}


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run ``callback(module)`` once ``name`` has executed (now, if it already has)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _GUARDS[name] = (None, callback)


class _GuardedLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        around, after = _GUARDS[self._name]
        with around() if around is not None else contextlib.nullcontext():
            self._inner.exec_module(module)
        if after is not None:
            after(module)


class _GuardFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _GUARDS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _GuardedLoader(spec.loader, fullname)
                return spec
        return None


def install() -> None:
    if not any(isinstance(f, _GuardFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _GuardFinder())


install()
