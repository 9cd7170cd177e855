"""The hook's wrapping, without vLLM: classes shaped like vLLM's and vllm-omni's runner chains.

GPUModelRunner.load_model -> CPUModelRunner overrides it WITHOUT super() -> vllm-omni's OmniGPUModelRunner calls
super() and then keeps setting up -> GPUARModelRunner calls super() again. The callback must fire exactly once
per outermost call, after the outermost method returned, and never touch the step methods.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kv_exporter.plugin import hooks
from kv_exporter.plugin.hooks import MethodHook, install_on_class, install_post_import, is_wrapped
from tests.support.plugin_state import forget_warnings


class Events:
    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []

    def published(self) -> list[Any]:
        return [what for kind, what in self.log if kind == "published"]


def make_classes(events: Events) -> dict[str, type]:
    class GPUModelRunner:
        def __init__(self, name: str) -> None:
            self.name = name
            self.model: list[str] = []

        def load_model(self, *args: Any, **kwargs: Any) -> None:
            events.log.append(("GPUModelRunner.load_model", self.name))
            self.model.append("weights")

        def execute_model(self, batch: int) -> int:
            return batch * 2

        def sample_tokens(self) -> str:
            return "tokens"

    class CPUModelRunner(GPUModelRunner):
        def load_model(self, load_dummy_weights: bool = False) -> None:  # no super(), like vLLM's
            events.log.append(("CPUModelRunner.load_model", self.name))
            self.model.append("cpu-weights")

    class OmniGPUModelRunner(GPUModelRunner):
        def load_model(self, *args: Any, **kwargs: Any) -> None:
            super().load_model(*args, **kwargs)
            self.model.append("omni-setup")  # work after super(): a publish inside super() would miss it

    class GPUARModelRunner(OmniGPUModelRunner):
        def load_model(self, *args: Any, **kwargs: Any) -> None:
            super().load_model(*args, **kwargs)
            self.model.append("ar-setup")

    return {
        "GPUModelRunner": GPUModelRunner,
        "CPUModelRunner": CPUModelRunner,
        "OmniGPUModelRunner": OmniGPUModelRunner,
        "GPUARModelRunner": GPUARModelRunner,
    }


@pytest.fixture
def chain() -> Iterator[tuple[Events, dict[str, type]]]:
    forget_warnings()
    events = Events()
    classes = make_classes(events)

    def after(runner: Any) -> None:
        events.log.append(("published", (runner.name, list(runner.model))))

    hook = MethodHook("fake", ("GPUModelRunner",), "load_model", after)
    install_on_class(classes["GPUModelRunner"], hook)
    install_on_class(classes["CPUModelRunner"], hook)
    yield events, classes
    assert not hooks._depth  # no depth state left behind


def test_base_runner_publishes_once_after_load(chain: tuple[Events, dict[str, type]]) -> None:
    events, classes = chain
    runner = classes["GPUModelRunner"]("gpu")
    runner.load_model()
    assert events.published() == [("gpu", ["weights"])]


def test_cpu_runner_without_super_still_publishes(chain: tuple[Events, dict[str, type]]) -> None:
    events, classes = chain
    classes["CPUModelRunner"]("cpu").load_model(load_dummy_weights=False)
    assert events.published() == [("cpu", ["cpu-weights"])]


def test_super_chain_publishes_once_after_the_outermost_returns(chain: tuple[Events, dict[str, type]]) -> None:
    events, classes = chain
    # Not installed on these: their own load_model is wrapped when the first instance is created.
    runner = classes["GPUARModelRunner"]("ar")
    assert is_wrapped(vars(classes["GPUARModelRunner"])["load_model"])
    assert is_wrapped(vars(classes["OmniGPUModelRunner"])["load_model"])
    runner.load_model("positional", keyword=True)
    assert events.published() == [("ar", ["weights", "omni-setup", "ar-setup"])]
    runner.load_model()  # a second load (e.g. a reload) publishes again, once
    assert len(events.published()) == 2


def test_subclass_defined_after_installation_is_covered(chain: tuple[Events, dict[str, type]]) -> None:
    events, classes = chain

    class LateRunner(classes["CPUModelRunner"]):  # type: ignore[misc, valid-type]
        def load_model(self, *args: Any, **kwargs: Any) -> None:
            super().load_model(*args, **kwargs)
            self.model.append("late-setup")

    LateRunner("late").load_model()
    assert events.published() == [("late", ["cpu-weights", "late-setup"])]


def test_each_instance_counts_on_its_own(chain: tuple[Events, dict[str, type]]) -> None:
    events, classes = chain
    outer = classes["OmniGPUModelRunner"]("outer")
    inner = classes["GPUModelRunner"]("inner")

    class LoadsAnotherRunnerMidway(list[str]):
        def append(self, item: str) -> None:
            super().append(item)
            if item == "weights":
                inner.load_model()  # another runner loading inside this one's load

    outer.model = LoadsAnotherRunnerMidway()
    outer.load_model()
    assert [name for name, _ in events.published()] == ["inner", "outer"]


def test_a_failing_load_publishes_nothing_and_propagates(chain: tuple[Events, dict[str, type]]) -> None:
    events, classes = chain

    class Broken(classes["GPUModelRunner"]):  # type: ignore[misc, valid-type]
        def load_model(self, *args: Any, **kwargs: Any) -> None:
            super().load_model()
            raise RuntimeError("weights missing")

    runner = Broken("broken")
    with pytest.raises(RuntimeError, match="weights missing"):
        runner.load_model()
    assert events.published() == []
    runner.load_model.__func__.__wrapped__  # noqa: B018  (functools.wraps keeps the original reachable)


def test_a_raising_callback_never_reaches_the_runner(caplog: pytest.LogCaptureFixture) -> None:
    forget_warnings()
    events = Events()
    classes = make_classes(events)

    def after(runner: Any) -> None:
        raise OSError("disk on fire")

    install_on_class(classes["GPUModelRunner"], MethodHook("fake", ("GPUModelRunner",), "load_model", after))
    runner = classes["GPUModelRunner"]("gpu")
    runner.load_model()
    runner.load_model()
    assert runner.model == ["weights", "weights"]
    assert [r.levelname for r in caplog.records if "disk on fire" in r.getMessage()] == ["WARNING"]


def test_step_methods_are_the_originals(chain: tuple[Events, dict[str, type]]) -> None:
    _, classes = chain
    gpu = classes["GPUModelRunner"]
    classes["GPUARModelRunner"]("ar")
    wrapped = {
        name: sorted(attr for attr, value in vars(cls).items() if is_wrapped(value)) for name, cls in classes.items()
    }
    # Only the base defines __init__ here; every class that defines load_model has it wrapped.
    assert wrapped == {
        "GPUModelRunner": ["__init__", "load_model"],
        "CPUModelRunner": ["load_model"],
        "OmniGPUModelRunner": ["load_model"],
        "GPUARModelRunner": ["load_model"],
    }
    assert gpu.__dict__["execute_model"].__qualname__.endswith("GPUModelRunner.execute_model")
    assert not hasattr(gpu.execute_model, "__wrapped__") and not hasattr(gpu.sample_tokens, "__wrapped__")
    assert gpu("x").execute_model(21) == 42


def test_installing_twice_wraps_once(chain: tuple[Events, dict[str, type]]) -> None:
    events, classes = chain
    hook = MethodHook("fake", ("GPUModelRunner",), "load_model", lambda runner: None)
    before = vars(classes["GPUModelRunner"])["load_model"]
    install_on_class(classes["GPUModelRunner"], hook)
    assert vars(classes["GPUModelRunner"])["load_model"] is before
    classes["GPUModelRunner"]("gpu").load_model()
    assert len(events.published()) == 1


# --- the post-import hook, on real modules written to disk ------------------------------------------------------

RUNNER_SOURCE = textwrap.dedent(
    '''
    class Runner:
        def __init__(self):
            self.loaded = False

        def load_model(self):
            """The real docstring."""
            self.loaded = True

        def execute_model(self):
            return "step"
    '''
)


@pytest.fixture
def module_dir(tmp_path: Path) -> Iterator[Path]:
    sys.path.insert(0, str(tmp_path))
    before = list(sys.meta_path)
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.meta_path[:] = before
    for name in [m for m in sys.modules if m.startswith("kvx_fake_")]:
        del sys.modules[name]


def write_package(root: Path, name: str, source: str) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "runner.py").write_text(source)


def test_modules_are_patched_when_first_imported(module_dir: Path) -> None:
    write_package(module_dir, "kvx_fake_vllm", RUNNER_SOURCE)
    published: list[Any] = []
    hook = MethodHook("kvx_fake_vllm.runner", ("Runner",), "load_model", published.append)
    install_post_import({hook.module: lambda module: hooks.install_on_module(module, [hook])})
    assert "kvx_fake_vllm.runner" not in sys.modules  # nothing imported at registration
    module = importlib.import_module("kvx_fake_vllm.runner")
    runner = module.Runner()
    runner.load_model()
    assert published == [runner] and runner.loaded
    # The module keeps its real loader: inspect (and torch.compile) read source through it.
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert module.__spec__.loader is module.__loader__
    assert "The real docstring." in inspect.getsource(module.Runner)
    assert inspect.getsource(module.Runner.load_model).lstrip().startswith("def load_model")


def test_already_imported_modules_are_patched_at_once(module_dir: Path) -> None:
    write_package(module_dir, "kvx_fake_early", RUNNER_SOURCE)
    module = importlib.import_module("kvx_fake_early.runner")
    hook = MethodHook("kvx_fake_early.runner", ("Runner",), "load_model", lambda runner: None)
    install_post_import({hook.module: lambda m: hooks.install_on_module(m, [hook])})
    assert is_wrapped(vars(module.Runner)["load_model"])


def test_a_failing_patch_never_fails_the_import(module_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    forget_warnings()
    write_package(module_dir, "kvx_fake_broken", RUNNER_SOURCE)

    def patch(module: ModuleType) -> None:
        raise AttributeError("vLLM renamed everything")

    install_post_import({"kvx_fake_broken.runner": patch})
    module = importlib.import_module("kvx_fake_broken.runner")
    assert module.Runner().execute_model() == "step"
    assert any("vLLM renamed everything" in r.getMessage() for r in caplog.records)


def test_a_missing_class_is_skipped(module_dir: Path) -> None:
    write_package(module_dir, "kvx_fake_renamed", "class Other:\n    pass\n")
    hook = MethodHook("kvx_fake_renamed.runner", ("Runner",), "load_model", lambda runner: None)
    install_post_import({hook.module: lambda m: hooks.install_on_module(m, [hook])})
    assert importlib.import_module("kvx_fake_renamed.runner").Other
