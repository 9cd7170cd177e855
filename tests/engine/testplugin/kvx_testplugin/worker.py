"""A CPU worker whose runner is a subclass that keeps working after `super().load_model()`.

vllm-omni's runners do exactly that (OmniGPUModelRunner.load_model calls super, then sets up more), so the
hook must publish when the OUTERMOST load_model returns: here the late owner is attached only after the
inner call, and a manifest written from inside it would miss it. Used with
`--worker-cls kvx_testplugin.worker.KvxCPUWorker`. Its warm-up likewise runs real forwards ("captures
buckets") after `super().compile_or_warm_up_model()`.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from kvx_testplugin.geometry import CAPTURE_SIZES
from kvx_testplugin.model import LateOwner, record


class KvxCPUModelRunner(CPUModelRunner):
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self.model.kvx_late = LateOwner()
        record("runner", late_attached=True, runner_class=type(self).__name__)


class KvxCPUWorker(cpu_worker.CPUWorker):
    def init_device(self) -> None:
        # CPUWorker.init_device builds `CPUModelRunner(...)` by its module-level name; swap it for the call only.
        original = cpu_worker.CPUModelRunner
        cpu_worker.CPUModelRunner = KvxCPUModelRunner  # type: ignore[misc]
        try:
            super().init_device()
        finally:
            cpu_worker.CPUModelRunner = original  # type: ignore[misc]

    def compile_or_warm_up_model(self) -> Any:
        # Work after super(): a warm-up manifest written inside the inner call would miss these buckets.
        result = super().compile_or_warm_up_model()
        for size in CAPTURE_SIZES:
            self.model_runner._dummy_run(size)
        record("worker", captured=list(CAPTURE_SIZES))
        return result
