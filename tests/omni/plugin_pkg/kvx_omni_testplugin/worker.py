"""A CPU worker for vllm-omni's LLM_AR stages whose runner runs vllm-omni's real runner chain.

``KvxCPUARModelRunner(GPUARModelRunner, CPUModelRunner)`` gives the MRO
GPUARModelRunner -> OmniGPUModelRunner -> ... -> CPUModelRunner -> GPUModelRunner, so ``load_model`` goes
through vllm-omni's AR runner and OmniGPUModelRunner (which logs the model-local KV total after its own
super() call) down to CPUModelRunner, which loads the weights on CPU without calling GPUModelRunner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import vllm.v1.worker.cpu_worker as cpu_worker_module
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin


class KvxCPUARModelRunner(GPUARModelRunner, CPUModelRunner):
    """vllm-omni's AR runner on vLLM's CPU runner (no method of either is replaced)."""


@contextlib.contextmanager
def _cpu_worker_builds(runner_cls: type[CPUModelRunner]) -> Iterator[None]:
    # CPUWorker.init_device constructs the module-level name CPUModelRunner; swapping that name for the
    # duration of the call builds our runner once, in the place and order vLLM builds its own.
    original = cpu_worker_module.CPUModelRunner
    cpu_worker_module.CPUModelRunner = runner_cls  # type: ignore[misc]
    try:
        yield
    finally:
        cpu_worker_module.CPUModelRunner = original  # type: ignore[misc]


class KvxCPUARWorker(OmniWorkerMixin, CPUWorker):
    """vLLM's CPUWorker plus vllm-omni's worker mixin (omni plugins), running the omni AR runner."""

    def init_device(self) -> None:
        if self.use_v2_model_runner:
            raise RuntimeError("the CPU omni test worker supports the v1 model runner only")
        with _cpu_worker_builds(KvxCPUARModelRunner):
            super().init_device()
