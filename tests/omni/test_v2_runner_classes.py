"""The hook on vllm-omni 0.30's Model Runner V2 family (vllm_omni/worker_v2/), on the real classes in .venv-omni.

V2 needs a GPU with Triton, so no engine is served here. Instead the real classes are imported through the hook as a
worker would import them, a runner of each concrete class is built far enough for the hook to complete its MRO, and
the real OmniGPUModelRunner.load_model runs: only vLLM's own V2 load (the innermost super() call, which needs the GPU)
is replaced by one that puts a small model with a declarer in place. The manifest must be published once, after
vllm-omni's own set-up that follows super().load_model(), and execute_model must be untouched.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.omni.omni_server import OMNI_PYTHON

SCRIPT = r"""
import glob, json, os, sys
import torch
import vllm.v1.worker.gpu.model_runner as v2
from kv_exporter.protocol import ModelLocalKVScope, ModelLocalKVSpec, RowDriver

class Codec(torch.nn.Module):
    def __init__(self, runner):
        super().__init__()
        self.runner = [runner]  # not a submodule
        self.setup_done_when_declared = None
    def model_local_kv_specs(self):
        # vllm-omni sets _exclude_full_graph after super().load_model() returns: published after it, or not at all.
        self.setup_done_when_declared = hasattr(self.runner[0], "_exclude_full_graph")
        return [ModelLocalKVSpec(name="codec_cache", layers=2, kv_heads=2, head_dim=32, dtype="float32",
                                 physical_capacity_positions=16, capacity_source="test", rows=RowDriver.MAX_NUM_SEQS,
                                 scope=ModelLocalKVScope.REQUEST)]

inner_loads = []
def gpu_load(self, *args, **kwargs):  # vLLM's V2 load: needs the GPU; puts a model in place instead
    inner_loads.append(type(self).__name__)
    self.model = torch.nn.Module()
    self.model.codec = Codec(self)
v2.GPUModelRunner.load_model = gpu_load

import kv_exporter
kv_exporter.register()
from kv_exporter.plugin.hooks import is_wrapped
from vllm_omni.worker_v2.omni_ar_model_runner import OmniARModelRunner
from vllm_omni.worker_v2.omni_generation_model_runner import OmniGenerationModelRunner
from vllm_omni.worker_v2.omni_model_runner import OmniGPUModelRunner
out = {"base_wrapped": is_wrapped(OmniGPUModelRunner.__dict__["load_model"]), "runs": {}}
for cls in (OmniARModelRunner, OmniGenerationModelRunner):
    runner = object.__new__(cls)
    try:  # the real __init__ chain: the hook completes the MRO first, then vLLM's __init__ needs a config
        cls.__init__(runner)
    except TypeError:
        pass
    runner.supports_mm_inputs = False
    runner.device = torch.device("cpu")
    folder = os.path.join(sys.argv[1], cls.__name__)
    os.environ["KV_EXPORTER_DIR"] = folder
    cls.load_model(runner)
    manifests = [json.load(open(p)) for p in glob.glob(os.path.join(folder, "*.json"))]
    out["runs"][cls.__name__] = {
        "manifests": [[d["owner"], d["name"]] for m in manifests for d in m["declarations"]],
        "phases": [m["phase"] for m in manifests],
        "declared_after_setup": runner.model.codec.setup_done_when_declared,
        "wrapped": sorted(k for klass in cls.__mro__ for k, v in vars(klass).items() if is_wrapped(v)),
        "execute_model_wrapped": is_wrapped(cls.execute_model),
    }
out["inner_loads"] = inner_loads
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("v2")
    env_code = "import os; os.environ['KV_EXPORTER_OBSERVE_INTERVAL'] = '0'\n"
    process = subprocess.run(
        [str(OMNI_PYTHON), "-c", env_code + SCRIPT, str(folder)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=Path(__file__).resolve().parents[2],  # this checkout's kv_exporter, ahead of the installed one
    )
    assert process.returncode == 0, process.stderr[-4000:]
    (line,) = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    parsed: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return parsed


@pytest.mark.parametrize("runner", ["OmniARModelRunner", "OmniGenerationModelRunner"])
def test_each_v2_runner_publishes_once_after_vllm_omni_s_own_setup(result: dict[str, Any], runner: str) -> None:
    run = result["runs"][runner]
    assert run["manifests"] == [["codec", "codec_cache"]] and run["phases"] == ["load"]
    assert run["declared_after_setup"] is True  # the outermost call: after what follows super().load_model()
    assert "load_model" in run["wrapped"] and not run["execute_model_wrapped"]
    assert set(run["wrapped"]) == {"__init__", "load_model"}  # nothing on the per-step path


def test_the_v2_family_base_is_hooked_and_vllm_s_own_load_ran_once_per_runner(result: dict[str, Any]) -> None:
    assert result["base_wrapped"] is True
    assert result["inner_loads"] == ["OmniARModelRunner", "OmniGenerationModelRunner"]
