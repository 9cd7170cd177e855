"""The hook on vLLM 0.34.0's real runner and worker classes (.venv-vllm34), without an engine.

vLLM 0.34 removed the V1 runners: Model Runner V2 is the only one, and its CPU runner subclasses it. No CPU build of
0.34 exists and V2 needs a GPU, so, as for V2 on 0.32 (tests/omni/test_v2_runner_classes.py), the real classes are
imported through the hook as a worker imports them, runners and workers are built far enough for the hook, and their
real methods run: only the innermost steps that need a GPU are replaced (V2's own load puts a small declaring model in
place; warm-up's body and the KV cache's commit do nothing on the device). What the hook takes must be final:

- an engine with vLLM 0.34's extensible KV cache commits its pages after `compile_or_warm_up_model` returns, in
  `extend_kv_cache`: the warm-up manifest is written then, with the final block count, not before;
- the allocator cap vLLM sets (`ExtensibleKVCache.set_torch_memory_limit`, its real code) is read back in bytes, with
  torch's CUDA allocator the one faked boundary (tests/support/fake_cuda.py);
- the engine's budget (blocks, bytes, resolved utilization, extensible mode) is read from 0.34's real CacheConfig.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.constants import REPO
from tests.vllm34.conftest import VLLM34_PYTHON

GIB = 1 << 30
TOTAL = 80 * GIB
CAP = 23 * GIB  # what vLLM lets torch reserve: its reservation at sizing plus what stays free
BLOCKS = 4321
KV_BYTES = 61 * GIB

SCRIPT = r"""
import glob, importlib.util, json, os, sys, types
import torch
folder = sys.argv[1]
os.environ["KV_EXPORTER_DIR"] = folder
import vllm
import vllm.v1.worker.gpu.model_runner as v2
from kv_exporter.protocol import ModelLocalKVScope, ModelLocalKVSpec, RowDriver

class Codec(torch.nn.Module):
    def model_local_kv_specs(self):
        return [ModelLocalKVSpec(name="codec_cache", layers=2, kv_heads=2, head_dim=32, dtype="float32",
                                 physical_capacity_positions=16, capacity_source="test", rows=RowDriver.MAX_NUM_SEQS,
                                 scope=ModelLocalKVScope.REQUEST)]

inner_loads = []
def gpu_load(self, *args, **kwargs):  # V2's own load needs the GPU: puts a small declaring model in place instead
    inner_loads.append(type(self).__name__)
    self.model = torch.nn.Module()
    self.model.codec = Codec()
v2.GPUModelRunner.load_model = gpu_load

import kv_exporter
kv_exporter.register()
from kv_exporter.plugin.hooks import is_wrapped
import vllm.v1.worker.gpu_worker as gw, vllm.v1.worker.cpu_worker as cw, vllm.v1.worker.cpu.model_runner as cm
import vllm.v1.worker.cpu.standalone_model_runner as sm
from vllm.config import CacheConfig
from vllm.v1.worker.extensible_kv_cache import ExtensibleKVCache
from tests.support.fake_cuda import FakeCuda, patch_torch

def wrapped(cls):
    return sorted(k for k, v in vars(cls).items() if is_wrapped(v))

def manifests():
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(folder, "*.json")))]

out = {"version": vllm.__version__, "inner_loads": inner_loads, "runs": {}}
out["v1_modules"] = [n for n in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner")
                     if importlib.util.find_spec(n) is not None]
out["wrapped"] = {name: wrapped(cls) for name, cls in (("GPUModelRunner", v2.GPUModelRunner), ("Worker", gw.Worker),
                  ("CPUWorker", cw.CPUWorker), ("StandaloneCPUModelRunner", sm.StandaloneCPUModelRunner))}
out["cpu_runner_bases"] = [c.__name__ for c in cm.CPUModelRunner.__mro__[:2]]

def runner_of(cls, device, max_num_seqs, cache_config):
    runner = object.__new__(cls)
    try:  # the real __init__ chain: the hook completes the MRO first, then vLLM's __init__ needs a config
        cls.__init__(runner)
    except TypeError:
        pass
    runner.device = device
    runner.scheduler_config = types.SimpleNamespace(max_num_seqs=max_num_seqs)
    runner.model_config = types.SimpleNamespace(served_model_name=f"m-{cls.__name__}", model="m")
    runner.cache_config = cache_config
    runner.eplb = types.SimpleNamespace(suppress=lambda: __import__("contextlib").nullcontext())
    runner.extensible_kv_cache = None
    runner.kv_caches = []
    return runner

def worker_of(cls, runner):
    worker = object.__new__(cls)
    worker.model_runner, worker.cache_config, worker.device = runner, runner.cache_config, runner.device
    worker._kv_cache_config = None  # what initialize_from_config keeps for extend_kv_cache
    return worker

# Warm-up's body and the commit of the KV cache's pages need the device: vLLM's own wrappers around them run.
gw.Worker._compile_or_warm_up_model = lambda self: "warm"
def commit(runner, kv_cache_config, num_blocks):
    runner.extensible_kv_cache = types.SimpleNamespace(physical_bytes=int(sys.argv[3]))
gw.extend_kv_cache = commit

fake = FakeCuda(total=int(sys.argv[2]), allocated=18 << 30, reserved=19 << 30, peak=20 << 30)
with patch_torch(fake):
    for name, cls, device, extensible in (
        ("extensible", v2.GPUModelRunner, torch.device("cuda", 0), None),  # unset: on, as on CUDA by default
        ("classic", v2.GPUModelRunner, torch.device("cuda", 0), False),
        ("cpu", cm.CPUModelRunner, torch.device("cpu"), False),
    ):
        os.environ["KV_EXPORTER_DIR"] = folder = os.path.join(sys.argv[1], name)
        cache_config = CacheConfig(enable_extensible_kv_cache=True if extensible is None else extensible)
        runner = runner_of(cls, device, 8, cache_config)
        worker = worker_of(gw.Worker, runner)
        cls.load_model(runner)
        run = {"after_load": [m["phase"] for m in manifests()]}
        runner.kv_caches = [torch.zeros(2, 64, 16, 4)]  # the engine's paged KV, allocated before warm-up
        cache_config.num_gpu_blocks = 64
        if name == "extensible":  # vLLM sizes the cache at the end of warm-up and caps torch's allocator
            kv_cache = types.SimpleNamespace(buffer=types.SimpleNamespace(device=device))
            ExtensibleKVCache.set_torch_memory_limit(kv_cache, int(sys.argv[4]))
        worker.compile_or_warm_up_model()
        run["after_warmup"] = [m["phase"] for m in manifests()]
        if name == "extensible":
            worker.extend_kv_cache(int(sys.argv[5]))
            run["after_extend"] = [m["phase"] for m in manifests()]
        (manifest,) = manifests()
        run["declarations"] = [[d["owner"], d["name"]] for d in manifest["declarations"]]
        run["engine_memory"] = manifest["engine_memory"]
        run["cuda"] = manifest["observation"]["cuda"]
        run["cuda_unavailable"] = manifest["observation"]["cuda_unavailable"]
        run["schema_version"] = manifest["schema_version"]
        out["runs"][name] = run
out["fraction_set"] = fake.fraction
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("vllm34")
    env_code = "import os; os.environ['KV_EXPORTER_OBSERVE_INTERVAL'] = '3600'\n"
    args = [str(folder), str(TOTAL), str(KV_BYTES), str(CAP), str(BLOCKS)]
    process = subprocess.run(
        [str(VLLM34_PYTHON), "-c", env_code + SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=REPO,  # this checkout's kv_exporter and tests.support, ahead of the installed ones
    )
    assert process.returncode == 0, process.stderr[-4000:]
    (line,) = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    parsed: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return parsed


def test_it_is_vllm_0_34_whose_v1_runners_are_gone(result: dict[str, Any]) -> None:
    assert result["version"] == "0.34.0"
    assert result["v1_modules"] == []
    assert result["cpu_runner_bases"] == ["CPUModelRunner", "GPUModelRunner"]  # the CPU runner is V2's


def test_only_load_warm_up_and_the_kv_commit_are_wrapped(result: dict[str, Any]) -> None:
    assert result["wrapped"] == {
        "GPUModelRunner": ["__init__", "load_model"],
        "Worker": ["__init__", "compile_or_warm_up_model", "extend_kv_cache"],
        "CPUWorker": ["__init__", "compile_or_warm_up_model"],
        "StandaloneCPUModelRunner": ["__init__", "load_model"],
    }


@pytest.mark.parametrize("run", ["extensible", "classic", "cpu"])
def test_each_v2_runner_publishes_its_declarations_at_load(result: dict[str, Any], run: str) -> None:
    assert result["runs"][run]["after_load"] == ["load"]
    assert result["runs"][run]["declarations"] == [["codec", "codec_cache"]]
    assert result["runs"][run]["schema_version"] == 5


def test_the_cpu_runner_runs_v2_s_load_through_the_hook(result: dict[str, Any]) -> None:
    assert result["inner_loads"] == ["GPUModelRunner", "GPUModelRunner", "CPUModelRunner"]


def test_an_extensible_engine_s_warm_up_manifest_waits_for_its_kv_cache(result: dict[str, Any]) -> None:
    run = result["runs"]["extensible"]
    assert run["after_warmup"] == ["load"]  # the KV cache is not committed yet: nothing taken
    assert run["after_extend"] == ["warmup"]
    assert run["engine_memory"] == {
        "kv_cache_bytes": KV_BYTES,  # the committed pages, not the tensors warm-up used
        "kv_cache_blocks": BLOCKS,  # the final count extend_kv_cache commits
        "gpu_memory_utilization": 1.0,  # 0.34's default in extensible mode
        "extensible_kv_cache": True,
    }


def test_the_cap_vllm_sets_is_read_back_in_bytes(result: dict[str, Any]) -> None:
    cuda = result["runs"]["extensible"]["cuda"]
    assert result["fraction_set"] == CAP / TOTAL
    assert abs(cuda["limit_bytes"] - CAP) <= 1  # the fraction times the total, truncated
    assert cuda["limit_absent"] is None
    assert (cuda["allocated_bytes"], cuda["reserved_bytes"]) == (18 * GIB, 19 * GIB)


def test_a_classic_engine_publishes_at_the_end_of_warm_up(result: dict[str, Any]) -> None:
    run = result["runs"]["classic"]
    assert run["after_warmup"] == ["warmup"]
    assert run["engine_memory"] == {
        "kv_cache_bytes": 2 * 64 * 16 * 4 * 4,  # the paged KV tensors' storage
        "kv_cache_blocks": 64,
        "gpu_memory_utilization": 0.92,  # 0.34's default otherwise
        "extensible_kv_cache": False,
    }


def test_a_cpu_worker_says_it_has_no_allocator_figures(result: dict[str, Any]) -> None:
    run = result["runs"]["cpu"]
    assert run["cuda"] is None and run["cuda_unavailable"] == "not_cuda"
    assert run["after_warmup"] == ["warmup"]


def test_the_script_fails_on_a_missing_class(tmp_path: Path) -> None:
    """The harness can fail: a module 0.34 does not have is an import error, not a silent pass."""
    code = "import vllm.v1.worker.gpu_model_runner"
    process = subprocess.run([str(VLLM34_PYTHON), "-c", code], capture_output=True, text=True, timeout=300)
    assert process.returncode != 0 and "ModuleNotFoundError" in process.stderr
