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
bench_decode's same-server comparison (called through vLLM's dev-mode `/collective_rpc`), and `kvx_step_arms` turns
on its per-step comparison: each step runs with the hook's step-path work (observation's hooks and the step record's
wrapper) on or off at random, timed (`StepArms`), beside a probe of the step record's own cost.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from kv_exporter.observation import Observation
from kv_exporter.plugin import observe
from kv_exporter.plugin._steps import Record, StepWrapper
from kv_exporter.plugin.observe import registry
from kv_exporter.steprecord import new_record
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


def _plain(scheduler_output: Any) -> Any:
    """What every runner reads of its scheduler output anyway (the probe's shared part: its cache misses fall on
    whichever call comes first, so the order is random)."""
    return len(scheduler_output.num_scheduled_tokens)


def _passthrough(scheduler_output: Any) -> Any:
    """The least any wrapper does: a Python function that calls the plain one (Python to Python, no C frame)."""
    return _plain(scheduler_output)


# (pair, hooks on, sequences, a decode step: one token each, ns; the probe: each arm's ns and position, 0 first)
StepTime = tuple[int, bool, int, bool, int, dict[str, tuple[int, int]]]


class StepArms:
    """Steps in adjacent pairs, one with the hook's step-path work on and one off in random order, each timed around
    the worker's call of its runner (`self.model_runner.execute_model`, as vLLM's worker makes it).

    Off: the tracker's hooks report nowhere (`Registry.step_switch`) and every wrapped cache or layer method is
    its original again, as a paused observation leaves them, and the runner's step record wrapper is gone (the
    class's method is called); on: as the hook installed them. The sampler thread runs throughout (its cost is
    measured apart). Two adjacent steps share the machine's load of the moment, so a pair's ratio leaves most of
    this shared machine's drift out; a switch happens before a step, outside its timing, and costs both arms alike.

    Before each step, outside its timing, the probe times one call each, in random order, with this step's scheduler
    output: a plain function ("plain"), a Python function calling it ("python": the least any wrapper adds),
    the step record's writer around it with its record closed ("closed": its C-to-Python call alone) and the writer
    ("writer"; control: the plain function in every arm): what the record itself costs a step, in the worker,
    against what the timing resolves. The plain function reads what the writer reads,
    `len(scheduler_output.num_scheduled_tokens)`, as every runner does in its step: the difference is the
    wrapper's own work."""

    def __init__(self, installed: registry.Registry, runner: Any, control: bool = False) -> None:
        self._control = control  # both arms on: what the arms differ by when nothing tells them apart
        self._runner = runner
        self._record_wrapper = vars(runner)["execute_model"]  # the hook's, on the instance
        assert isinstance(self._record_wrapper, StepWrapper)
        closed, writer = (Record(bytearray(new_record(0, 0))) for _ in range(2))
        closed.close()
        probes: dict[str, Callable[[Any], Any]] = {
            "plain": _plain,
            "python": _passthrough,
            "closed": StepWrapper(_plain, closed),
            "writer": StepWrapper(_plain, writer),
        }
        self._probes = dict.fromkeys(probes, _plain) if control else probes
        self._hooks = installed.step_switch()
        self._current: bool | None = None
        self._pair = 0
        self._second: bool | None = None  # the arm the pair's second step runs
        self.times: list[StepTime] = []

    def choose(self) -> tuple[int, bool]:
        if self._second is None:
            on = random.random() < 0.5
            self._pair, self._second = self._pair + 1, not on
        else:
            on, self._second = self._second, None
        if on is not self._current:
            self.apply(on)
        return self._pair, on

    def apply(self, on: bool) -> None:
        hooked = on or self._control
        self._hooks(hooked)
        if hooked:
            vars(self._runner)["execute_model"] = self._record_wrapper
        else:
            vars(self._runner).pop("execute_model", None)
        self._current = on

    def probe(self, scheduler_output: Any) -> dict[str, tuple[int, int]]:
        """Each arm's (ns of one call, position): the first call meets the step's cold caches, so the order is random
        and kept."""
        order = random.sample(list(self._probes), len(self._probes))
        clock = time.perf_counter_ns
        times = {}
        for position, name in enumerate(order):
            call = self._probes[name]
            a = clock()
            call(scheduler_output)
            times[name] = (clock() - a, position)
        return times


class KvxRequestsCPUModelRunner(CPUModelRunner):
    step_arms: StepArms | None = None
    # (began, ended, sequences) of each step, CLOCK_MONOTONIC seconds, while a test asks for them (`kvx_steps`): the
    # worker's batches seen from inside the runner, independently of kv-exporter's step record.
    step_log: list[tuple[float, float | None, int]] | None = None

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        log = self.step_log
        if log is not None:
            log.append((time.monotonic(), None, len(scheduler_output.num_scheduled_tokens)))
            at = len(log) - 1
        try:
            owners = getattr(self.model, "kvx_observed", None)
            if owners is not None:
                finished = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
                owners.schedule(scheduler_output.num_scheduled_tokens, finished)
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            if log is not None:
                log[at] = (log[at][0], time.monotonic(), log[at][2])


class KvxRequestsCPUWorker(cpu_worker.CPUWorker):
    _kvx_on_sample: Callable[[Observation], None] | None = None  # the hook's, while kvx_observation pauses it

    def init_device(self) -> None:
        with builds(KvxRequestsCPUModelRunner):
            super().init_device()

    def execute_model(self, scheduler_output: Any) -> Any:
        runner = self.model_runner
        arms = getattr(runner, "step_arms", None)
        if arms is None:
            return super().execute_model(scheduler_output)
        pair, on = arms.choose()
        probe = arms.probe(scheduler_output)
        started = time.perf_counter_ns()
        try:
            return super().execute_model(scheduler_output)
        finally:
            elapsed = time.perf_counter_ns() - started
            scheduled = scheduler_output.num_scheduled_tokens
            decode = bool(scheduled) and max(scheduled.values()) == 1
            arms.times.append((pair, on, len(scheduled), decode, elapsed, probe))

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

    def kvx_steps(self, state: str) -> list[tuple[float, float | None, int]]:
        """ "on": log every step from now on (CLOCK_MONOTONIC seconds, which other processes of the machine share);
        "collect": the steps logged since the last call (a step still running has no end yet)."""
        runner = self.model_runner
        assert isinstance(runner, KvxRequestsCPUModelRunner)
        logged, runner.step_log = runner.step_log or [], []
        return logged if state == "collect" else []

    def kvx_step_arms(self, state: str) -> list[StepTime]:
        """ "on": from the next step, steps in pairs with the hook's step-path work on and off (observation must be
        running); "control": the same pairs, both on; "collect": the steps timed since the last call, as
        StepArms.times; "off": the hooks on again for good, and the last steps timed."""
        runner = self.model_runner
        assert isinstance(runner, KvxRequestsCPUModelRunner)
        arms = runner.step_arms
        if state in ("on", "control") and arms is None:
            runner.step_arms = arms = StepArms(observe._observer.registry, runner, control=state == "control")
        if arms is None:
            return []
        times, arms.times = arms.times, []
        if state == "off":
            runner.step_arms = None
            arms.apply(True)
        return times
