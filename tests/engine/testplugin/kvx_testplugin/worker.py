"""CPU workers whose runners are subclasses: one keeps working after `super().load_model()`, one tells the observed
architecture which requests each step runs.

vllm-omni's runners keep working after `super().load_model()` (OmniGPUModelRunner.load_model calls super, then sets up
more), so the hook must publish when the OUTERMOST load_model returns: `KvxCPUModelRunner` attaches the late owner
only after the inner call, and a manifest written from inside it would miss it. Used with
`--worker-cls kvx_testplugin.worker.KvxCPUWorker`. Its warm-up likewise runs real forwards ("captures buckets") after
`super().compile_or_warm_up_model()`.

`--worker-cls kvx_testplugin.worker.KvxRequestsCPUWorker` serves observed.py's architecture: its runner hands each
step's scheduled and finished request ids to `kvx_observed` before the step runs (a model's forward sees no request
ids), and changes nothing else. Its `kvx_observation` pauses and resumes the observation in the worker, for
bench_decode's same-server comparison (called through vLLM's dev-mode `/collective_rpc`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from kv_exporter.observation import Observation
from kv_exporter.plugin import observe
from kvx_testplugin.geometry import CAPTURE_SIZES
from kvx_testplugin.model import LateOwner, record


@contextmanager
def builds(runner_cls: type[CPUModelRunner]) -> Iterator[None]:
    """CPUWorker.init_device builds `CPUModelRunner(...)` by its module-level name; swap it for the call only."""
    original = cpu_worker.CPUModelRunner
    cpu_worker.CPUModelRunner = runner_cls  # type: ignore[misc]
    try:
        yield
    finally:
        cpu_worker.CPUModelRunner = original  # type: ignore[misc]


class KvxCPUModelRunner(CPUModelRunner):
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self.model.kvx_late = LateOwner()
        record("runner", late_attached=True, runner_class=type(self).__name__)


class KvxCPUWorker(cpu_worker.CPUWorker):
    def init_device(self) -> None:
        with builds(KvxCPUModelRunner):
            super().init_device()

    def compile_or_warm_up_model(self) -> Any:
        # Work after super(): a warm-up manifest written inside the inner call would miss these buckets.
        result = super().compile_or_warm_up_model()
        for size in CAPTURE_SIZES:
            self.model_runner._dummy_run(size)
        record("worker", captured=list(CAPTURE_SIZES))
        return result


class KvxRequestsCPUModelRunner(CPUModelRunner):
    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        owners = getattr(self.model, "kvx_observed", None)
        if owners is not None:
            finished = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
            owners.schedule(scheduler_output.num_scheduled_tokens, finished)
        return super().execute_model(scheduler_output, *args, **kwargs)


class KvxRequestsCPUWorker(cpu_worker.CPUWorker):
    _kvx_on_sample: Callable[[Observation], None] | None = None  # the hook's, while kvx_observation pauses it

    def init_device(self) -> None:
        with builds(KvxRequestsCPUModelRunner):
            super().init_device()

    def kvx_observation(self, state: str) -> str:
        """ "paused": the sampler stopped and new caches untracked, as near observation off as a process that has
        patched the cache class gets (its `__new__` stays, tracking nowhere; the peak's content hooks come off).
        "running": both back, publishing
        to the hook's own callback again. Returns the state now."""
        observer = observe._observer  # the hook's per-process observer: reached into by this test worker only
        if state == "paused" and observer.sampler is not None and observer.sampler.running:
            self._kvx_on_sample = observer.sampler.on_sample
            observe.stop()
            observer.registry.detach()
        elif state == "running" and self._kvx_on_sample is not None:
            observe.patch_cache_module(sys.modules[observe.CACHE_MODULE])
            observe.start(self._kvx_on_sample)
        sampler = observer.sampler
        return "running" if sampler is not None and sampler.running else "paused"
