"""The step record on vLLM's real runner and worker classes, without an engine: vLLM 0.32's V1 runners (served for
real in test_running_steps.py) and its Model Runner V2 (which needs a GPU with Triton), and vLLM 0.34's runners, which
are Model Runner V2 only (`.venv-vllm34`, built by the vLLM 0.34 tests' `make vllm34-env`; skipped where absent).

On each real runner class, a bare instance gets the hook's wrapper as publish puts it, and is called as its worker
calls it, with vLLM's own `SchedulerOutput`: the step's sequences are recorded, and what the real method does with
the call (on a bare instance: raise, for want of its state) passes through unchanged. From the real sources: each
worker calls `self.model_runner.execute_model(...)` (the instance attribute, so the wrapper), and Model Runner V2's
warm-up calls `self.execute_model(..., dummy_run=True)`, which the wrapper does not count as a step.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.engine.server import VLLM_PYTHON
from tests.support.constants import REPO

VLLM34_PYTHON = REPO / ".venv-vllm34" / "bin" / "python"

SCRIPT = r"""
import importlib, inspect, json, os, sys, tempfile
from pathlib import Path
import vllm
from vllm.v1.core.sched.output import SchedulerOutput
from kv_exporter.manifest import ProcessInfo
from kv_exporter.plugin import steps
from kv_exporter.steprecord import decode

RUNNERS = json.loads(sys.argv[1])
WORKERS = json.loads(sys.argv[2])
out = {"version": vllm.__version__, "runners": {}, "workers": {}}
folder = Path(tempfile.mkdtemp())
for name in RUNNERS:
    module, _, cls_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except ImportError:
        out["runners"][name] = "absent"
        continue
    runner = object.__new__(cls)
    path = steps.attach(runner, folder / (cls.__module__ + "." + cls_name + ".json"), ProcessInfo.current())
    output = SchedulerOutput.make_empty()
    output.num_scheduled_tokens = {"a": 3, "b": 1, "c": 1}
    try:
        runner.execute_model(output, None)
        raised = None
    except Exception as exc:
        raised = type(exc).__name__
    record = decode(path.read_bytes())
    source = inspect.getsource(cls)
    out["runners"][name] = {
        "first_parameter": list(inspect.signature(cls.execute_model).parameters)[1],
        "raised": raised,
        "steps": [record.steps, record.finished, record.latest],
        "dummy_runs_marked": "self.execute_model(" not in source or "dummy_run=True" in source,
    }
for name in WORKERS:
    module, _, cls_name = name.partition(":")
    cls = getattr(importlib.import_module(module), cls_name)
    execute = inspect.getsource(inspect.unwrap(cls.execute_model))
    out["workers"][name] = "self.model_runner.execute_model(" in execute
print("RESULT " + json.dumps(out))
"""

V032_RUNNERS = [
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner",
    "vllm.v1.worker.cpu.model_runner:CPUModelRunner",
]
# 0.34 removed the V1 runners (FIELD-NOTES): Model Runner V2 and its CPU subclass remain.
V034_RUNNERS = ["vllm.v1.worker.gpu.model_runner:GPUModelRunner", "vllm.v1.worker.cpu.model_runner:CPUModelRunner"]
WORKERS = ["vllm.v1.worker.gpu_worker:Worker", "vllm.v1.worker.cpu_worker:CPUWorker"]


def run(python: Path, runners: list[str]) -> dict[str, Any]:
    process = subprocess.run(
        [str(python), "-c", SCRIPT, json.dumps(runners), json.dumps(WORKERS)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=REPO,  # this checkout's kv_exporter, ahead of the installed one
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert process.returncode == 0, process.stderr[-4000:]
    (line,) = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


@pytest.fixture(
    scope="module",
    params=[(VLLM_PYTHON, "0.32", V032_RUNNERS), (VLLM34_PYTHON, "0.34", V034_RUNNERS)],
    ids=["vllm-0.32", "vllm-0.34"],
)
def classes(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[str]]:
    python, version, runners = request.param
    if not python.exists():
        pytest.skip(f"no {python.parent.parent.name} (vLLM {version}'s environment)")
    result = run(python, runners)
    assert result["version"].startswith(version), result["version"]
    return result, runners


def test_each_real_runner_s_step_is_recorded_and_its_own_behaviour_passes_through(
    classes: tuple[dict[str, Any], list[str]],
) -> None:
    result, runners = classes
    for name in runners:
        runner = result["runners"][name]
        assert runner != "absent", name
        assert runner["first_parameter"] == "scheduler_output", name
        # A bare instance lacks the state the real method reads: its own error, the step begun and ended.
        assert runner["raised"] in ("AttributeError", "RuntimeError", "TypeError"), (name, runner)
        assert runner["steps"] == [1, 1, 3], (name, runner)  # three requests scheduled
        assert runner["dummy_runs_marked"], name


def test_each_real_worker_calls_its_runner_s_instance_attribute(classes: tuple[dict[str, Any], list[str]]) -> None:
    result, _ = classes
    assert result["workers"] == dict.fromkeys(WORKERS, True)
