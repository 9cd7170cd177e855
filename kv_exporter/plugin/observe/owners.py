"""Which module a cache belongs to, decided when it is created, by walking the creating thread's frames.

The owner is the module whose code the first frame of the model's modules on the stack runs (a helper function it
calls counts as its code), else `UNATTRIBUTED_OWNER`. When that module declares nothing but a module above it in the
model's tree declares (the nearest one by path), the cache may be the memory that ancestor declares (a declarer whose
child builds the cache it declares): it is charged to the ancestor only if its first K/V tensor has the geometry of
one of the ancestor's declarations (layers, KV heads, head size, dtype), else to the module that made it, as
undeclared. A declaring ancestor can therefore never hide a cache of another shape under its ceiling. Paths are the
`named_modules()` paths of the unwrapped model, as the collector records declaration owners.

Once the model is known (`ModelMap`) the tracker's walk (in C, `_tracker.c`) looks each frame's code object up in
`ModelMap.sites`, built from the methods of the model's module classes, by identity (Python hashes a code object's
whole content on every lookup, ~0.2-0.5 us), and stops at the first it finds: each module's attribution is computed
once, when the model is attached, and a frame's `self` is read (`shared_owner`) only where several modules share
that code. Before the model is known
(during load), `StackModules` records weak references to the modules whose methods are on the stack, and
`ModelMap.resolve` names them later.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from types import CodeType, FrameType, FunctionType
from typing import Any, NamedTuple

from kv_exporter.observation import UNATTRIBUTED_OWNER
from kv_exporter.protocol import _unwrap  # the collector's own unwrapping: the same paths as the declarations

ModuleRef = weakref.ref[Any]


class Geometry(NamedTuple):
    """A declaration's shape, or what a cache shows of its own at its first K/V tensor: layers, KV heads, head
    size, dtype name (e.g. "float32")."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str


class Shape(NamedTuple):
    """What a cache shows of its shape at its first tensor; `growing`: it appends layers as they are first used
    (a plain DynamicCache), so `geometry.layers` is only how many it has so far."""

    geometry: Geometry
    growing: bool

    def fits(self, declared: Geometry) -> bool:
        shown = self.geometry
        if shown[1:] != declared[1:]:
            return False
        return shown.layers <= declared.layers if self.growing else shown.layers == declared.layers


class Attribution(NamedTuple):
    """The module that made a cache, and the declaring module further out whose declared memory it may be."""

    owner: str
    candidate: str | None = None


class Site:
    """Code several of the model's modules run (an inherited method): which one made a cache is told by the frame's
    `self`."""

    __slots__ = ("self_name",)

    def __init__(self, code: CodeType) -> None:
        self.self_name = code.co_varnames[0]  # the name of its first parameter


class ModelMap:
    """The model's modules, by path and by the code they run. Holds the model weakly."""

    def __init__(
        self,
        model: object,
        declared: Mapping[str, Collection[Geometry]],
        module_type: type[Any],
        on_release: Callable[[ModuleRef], None] | None = None,
    ) -> None:
        root = _unwrap(model)
        self.root: ModuleRef = weakref.ref(root, on_release)
        self.declared = {owner: frozenset(shapes) for owner, shapes in declared.items()}
        self.declaring = frozenset(declared)
        self._paths: dict[int, str] = {}
        by_class: dict[type, list[str]] = {}
        for path, module in root.named_modules():  # type: ignore[attr-defined]
            self._paths[id(module)] = path
            by_class.setdefault(type(module), []).append(path)
        self._attributions = {path: self._attribution(path) for path in self._paths.values()}
        # id(code) -> the attribution of the one module running it, or a Site where several share it (the tracker's
        # frame walk looks each frame's code up here and stops at the first it finds).
        self.sites: dict[int, Attribution | Site] = self._build_sites(by_class, module_type)

    def describes(self, model: object, declared: Mapping[str, Collection[Geometry]]) -> bool:
        return self.root() is _unwrap(model) and self.declared == {o: frozenset(g) for o, g in declared.items()}

    def declares(self, owner: str, shape: Shape) -> bool:
        return any(shape.fits(declared) for declared in self.declared.get(owner, ()))

    def _build_sites(self, by_class: dict[type, list[str]], module_type: type[Any]) -> dict[int, Attribution | Site]:
        # By id, here too: two methods with the same name, line and body in different files compare equal.
        codes: dict[int, CodeType] = {}
        paths_by_code: dict[int, list[str]] = {}
        for cls, paths in by_class.items():
            for code in {id(code): code for code in _method_codes(cls, module_type)}.values():
                codes[id(code)] = code
                paths_by_code.setdefault(id(code), []).extend(paths)
        self._codes = list(codes.values())  # kept alive as long as the map: `sites` names them by id
        return {
            key: self._attributions[paths[0]] if len(paths) == 1 else Site(codes[key])
            for key, paths in paths_by_code.items()
        }

    def shared_owner(self, site: Site, frame: FrameType) -> Attribution | None:
        """The attribution of `frame`, running `site`'s shared code, by its `self`; None: not one of the model's."""
        path = self._paths.get(id(frame.f_locals.get(site.self_name)))
        return None if path is None else self._attributions[path]

    def resolve(self, modules: Sequence[ModuleRef]) -> Attribution:
        """The attribution of a cache created before the model was known, from the modules on its stack then."""
        for ref in modules:
            module = ref()
            path = None if module is None else self._paths.get(id(module))
            if path is not None:
                return self._attributions[path]
        return _UNATTRIBUTED

    def _attribution(self, path: str) -> Attribution:
        """A module's own path, and the nearest declaring module above it in the tree when it declares nothing."""
        if path in self.declaring:
            return Attribution(path)
        parts = path.split(".") if path else []
        for depth in range(len(parts) - 1, -1, -1):
            ancestor = ".".join(parts[:depth])
            if ancestor in self.declaring:
                return Attribution(path, ancestor)
        return Attribution(path)


_UNATTRIBUTED = Attribution(UNATTRIBUTED_OWNER)


def _method_codes(cls: type, module_type: type[Any]) -> Iterator[CodeType]:
    """The code of every plain method `cls` has, own or inherited, short of torch's Module itself."""
    stop = set(module_type.__mro__)
    for klass in cls.__mro__:
        if klass in stop:
            continue
        for value in vars(klass).values():
            code = _method_code(value)
            if code is not None:
                yield code


def _method_code(value: object) -> CodeType | None:
    """The code a method runs: through `functools.wraps` decorators (torch.no_grad's wrapper is shared by all)."""
    if not isinstance(value, FunctionType):
        return None
    function = inspect.unwrap(value)
    code = getattr(function, "__code__", None)
    if not isinstance(code, CodeType) or code.co_argcount < 1:
        return None
    return code


class StackModules:
    """Before the model is known: the modules whose own methods are running on a stack, innermost first.

    A frame's code is matched with its defining class through its qualified name (Python 3.11+), once per code,
    so only the frames of methods of torch Module subclasses (and of their mixins) are asked for their `self`:
    reading a frame's locals makes Python 3.11-3.12 keep a snapshot of them until the frame returns.
    """

    def __init__(self, module_type: type[Any]) -> None:
        self._module_type = module_type
        self._self_names: dict[int, tuple[CodeType, str | None]] = {}  # id(code) -> (code, kept alive; name)

    def on_stack(self, frame: FrameType | None) -> tuple[ModuleRef, ...]:
        found: list[ModuleRef] = []
        names = self._self_names
        while frame is not None:
            code = frame.f_code
            known = names.get(id(code))
            if known is None:
                known = names[id(code)] = (code, self._self_name(code, frame.f_globals))
            name = known[1]
            if name is not None:
                candidate = frame.f_locals.get(name)
                if isinstance(candidate, self._module_type):
                    found.append(weakref.ref(candidate))
            frame = frame.f_back
        return tuple(found)

    def _self_name(self, code: CodeType, namespace: dict[str, Any]) -> str | None:
        """The first parameter's name when `code` is a method a Module subclass defines, else None."""
        qualname = getattr(code, "co_qualname", "")  # absent before Python 3.11: nothing is matched there
        *class_path, attribute = qualname.split(".")
        if not class_path or "<" in qualname or code.co_argcount < 1:
            return None
        owner: object = namespace.get(class_path[0])
        for name in class_path[1:]:
            owner = getattr(owner, name, None) if isinstance(owner, type) else None
        if not (isinstance(owner, type) and self._is_module_class(owner)):
            return None
        if _method_code(vars(owner).get(attribute)) is not code:
            return None
        return code.co_varnames[0]

    def _is_module_class(self, cls: type) -> bool:
        """A Module subclass, or a mixin of one (transformers' GenerationMixin, whose `generate` makes caches)."""
        module_type = self._module_type
        subclasses: list[type] = type.__subclasses__(cls)
        return issubclass(cls, module_type) or any(issubclass(sub, module_type) for sub in subclasses)
