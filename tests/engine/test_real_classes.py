"""The hook on vLLM 0.32's real runner and worker classes, in .venv-vllm, without starting an engine.

Model Runner V2 (vLLM 0.32's default on GPUs with Triton) cannot run on this CPU build ("Model Runner V2
requires Triton"), so its hook is checked here on the real classes rather than in a served engine.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.engine.conftest import run_in_vllm_venv

# (module, class) -> the attributes the hook may wrap on that class, and nothing else anywhere in the module.
EXPECTED = {
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner": ["__init__", "load_model"],
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner": ["__init__", "load_model"],
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner": ["__init__", "load_model"],
    "vllm.v1.worker.gpu_worker:Worker": ["__init__", "compile_or_warm_up_model"],
    "vllm.v1.worker.cpu_worker:CPUWorker": ["__init__", "compile_or_warm_up_model"],
}
MODULES = sorted({key.split(":")[0] for key in EXPECTED} | {"vllm.v1.worker.cpu.model_runner"})

SCRIPT = r"""
import importlib, inspect, json, os, sys, time
t0 = time.perf_counter()
import kv_exporter
kv_exporter.register()
kv_exporter.register()  # idempotent
register_s = time.perf_counter() - t0
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "vllm", "vllm_omni", "transformers"})
from kv_exporter.plugin.hooks import PostImportHook, is_wrapped
hooks_installed = sum(isinstance(f, PostImportHook) for f in sys.meta_path)
out = {"register_s": register_s, "heavy_after_register": heavy, "hooks_installed": hooks_installed, "wrapped": {}}
for name in json.loads(sys.argv[1]):
    module = importlib.import_module(name)
    out.setdefault("loaders", {})[name] = type(module.__loader__).__name__
    for attr, cls in vars(module).items():
        if isinstance(cls, type) and cls.__module__ == name:
            wrapped = sorted(k for k, v in vars(cls).items() if is_wrapped(v))
            if wrapped:
                out["wrapped"][f"{name}:{attr}"] = wrapped
cpu_v2 = importlib.import_module("vllm.v1.worker.cpu.model_runner").CPUModelRunner
out["cpu_v2_load_model_wrapped"] = is_wrapped(cpu_v2.load_model)
gpu = importlib.import_module("vllm.v1.worker.gpu_model_runner").GPUModelRunner
out["execute_model_source"] = inspect.getsourcefile(inspect.unwrap(gpu.execute_model))
out["load_model_source"] = inspect.getsourcefile(inspect.unwrap(gpu.load_model))
print("RESULT " + json.dumps(out))
"""


def run(disabled: bool) -> dict[str, Any]:
    prefix = "import os; os.environ['KV_EXPORTER_DISABLE'] = '1'\n" if disabled else ""
    code = f"import sys; sys.argv = ['x', {json.dumps(json.dumps(MODULES))}]\n{prefix}{SCRIPT}"
    [line] = [line for line in run_in_vllm_venv(code).stdout.splitlines() if line.startswith("RESULT ")]
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


@pytest.fixture(scope="module")
def enabled() -> dict[str, Any]:
    return run(disabled=False)


def test_only_load_and_warmup_entry_points_are_wrapped(enabled: dict[str, Any]) -> None:
    result = enabled
    assert result["wrapped"] == EXPECTED
    assert result["cpu_v2_load_model_wrapped"] is True  # inherited from the V2 GPUModelRunner
    assert result["execute_model_source"].endswith("vllm/v1/worker/gpu_model_runner.py")
    assert result["load_model_source"].endswith("vllm/v1/worker/gpu_model_runner.py")
    # Patched modules keep their real loader (inspect, linecache and torch.compile read source through it).
    assert set(result["loaders"].values()) == {"SourceFileLoader"}


def test_registration_is_cheap_and_idempotent(enabled: dict[str, Any]) -> None:
    result = enabled
    assert result["heavy_after_register"] == []
    assert result["hooks_installed"] == 1
    assert result["register_s"] < 1.0


def test_disabled_wraps_nothing() -> None:
    result = run(disabled=True)
    assert result["wrapped"] == {}
    assert result["hooks_installed"] == 0
