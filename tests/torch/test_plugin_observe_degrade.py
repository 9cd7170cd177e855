"""Observation never gets in the way: what it does when it cannot work, when it is off, and its thread.

Each degradation gives the state and reason the sidecar exports, one warning however often it recurs, and a
model that runs as before. Subprocess tests run from the checkout (the worktree's kv_exporter wins).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, Qwen2ForCausalLM

from kv_exporter.cachebytes import measure_cache_bytes
from kv_exporter.observation import UNATTRIBUTED_OWNER, CudaUnavailable, Observation, ObservationState
from kv_exporter.plugin import observe
from kv_exporter.plugin.settings import DEFAULT_OBSERVE_INTERVAL_S, HookSettings
from tests.support.cache_models import build, forward, full_config, prefill_and_decode, prompt
from tests.support.observing import by_owner, observer, sample, warnings_logged
from tests.support.plugin_state import forget_warnings

__all__ = ["observer"]  # the fixture, imported for pytest

ROOT = Path(__file__).resolve().parents[2]
THREAD_NAME = "kv-exporter-observe"


class TupleCache(DynamicCache, tuple):  # type: ignore[misc]
    """A real Cache subclass that cannot be weakly referenced: a tuple base leaves no room for weak references."""


def model_and_cache() -> tuple[Qwen2ForCausalLM, DynamicCache]:
    model = build(Qwen2ForCausalLM, full_config(), torch.float32)
    return model, prefill_and_decode(model, DynamicCache(), batch=1, prompt_len=5, decode_steps=1)


def observe_twice() -> tuple[Observation, Observation]:
    return observe.observe(pause=lambda: None), observe.observe(pause=lambda: None)


# -- degradations --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("observer")
def test_a_cache_class_without_weak_references_makes_the_observation_unavailable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, _ = model_and_cache()
    caches = [prefill_and_decode(model, TupleCache(), batch=1, prompt_len=5, decode_steps=1) for _ in range(2)]
    assert [cache.get_seq_length() for cache in caches] == [6, 6]  # the model ran with them
    first, second = observe_twice()
    assert first.state is second.state is ObservationState.UNAVAILABLE
    assert "TupleCache cannot be weakly referenced" in first.reason
    assert first.owners == ()
    assert warnings_logged(caplog, "TupleCache cannot be weakly referenced") == 1


@pytest.mark.usefixtures("observer")
def test_a_sample_that_fails_says_why_and_the_next_one_is_tried(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, cache = model_and_cache()
    registry = observe._observer.registry

    def broken(*args: object) -> object:
        raise RuntimeError("the registry is broken")

    monkeypatch.setattr(registry, "sample", broken)
    failed, again = observe_twice()
    assert failed.state is again.state is ObservationState.FAILING
    assert "the registry is broken" in failed.reason
    assert failed.taken_at > 0
    assert warnings_logged(caplog, "the sample failed") == 1
    monkeypatch.undo()
    assert by_owner(sample())[UNATTRIBUTED_OWNER].bytes == measure_cache_bytes(cache).allocated_bytes


def blocking(condition: str) -> str:
    """A child process's first lines: importing a module whose `name` meets `condition` fails as if it were not
    installed, and kv-exporter's log lines are collected in `warned`, each after its level."""
    return f"""
import json, logging, sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if {condition}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
warned = []
handler = logging.Handler()
handler.emit = lambda record: warned.append(f"{{record.levelname}} {{record.getMessage()}}")
logging.getLogger("vllm.kv_exporter").addHandler(handler)
"""


BLOCKED_TRANSFORMERS = (
    blocking('name.split(".")[0] == "transformers"')
    + """
from kv_exporter.plugin import observe, register
register()
import torch
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
out = model(torch.ones(2, 4))
observe.attach(model, [], torch.device("cpu"))
first, second = observe.observe(), observe.observe()
try:
    import transformers
    blocked = False
except ImportError:
    blocked = True
print(json.dumps({"blocked": blocked, "shape": list(out.shape), "states": [first.state.value, second.state.value],
                  "reason": first.reason, "warned": [w for w in warned if "transformers" in w]}))
"""
)


def run_python(code: str, **env: str) -> dict[str, object]:
    environ = {**os.environ, "KV_EXPORTER_OBSERVE_INTERVAL": "1", **env}
    environ.pop("KV_EXPORTER_DISABLE", None)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300, check=True
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_without_transformers_the_observation_is_unavailable_and_the_model_runs() -> None:
    result = run_python(BLOCKED_TRANSFORMERS)
    assert result["blocked"] is True
    assert result["shape"] == [2, 3]
    assert result["states"] == ["unavailable", "unavailable"]
    assert result["reason"] == "transformers is not installed"
    assert len(result["warned"]) == 1  # type: ignore[arg-type]


# The C tracker as an installation without a C compiler leaves it: absent.
UNBUILT_TRACKER = (
    blocking('name == "kv_exporter.plugin.observe._tracker"')
    + """
from kv_exporter.plugin import observe, register
register()
import torch
from transformers import DynamicCache
model = torch.nn.Linear(4, 3)
cache = DynamicCache()
keys, _ = cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
observe.attach(model, [], torch.device("cpu"))
first, second = observe.observe(), observe.observe()
print(json.dumps({"shape": list(keys.shape), "states": [first.state.value, second.state.value],
                  "reason": first.reason, "warned": [w for w in warned if "tracker" in w]}))
"""
)


def test_without_the_compiled_tracker_the_observation_says_so_and_the_model_runs() -> None:
    result = run_python(UNBUILT_TRACKER)
    assert result["shape"] == [1, 2, 3, 4]
    assert result["states"] == ["unavailable", "unavailable"]
    assert "cache tracker (a C extension) is not built" in str(result["reason"])
    # once where vLLM registers the plugin (extensions.py), once where the observation goes unavailable; not per sample
    levels = sorted(line.split()[0] for line in result["warned"])  # type: ignore[attr-defined]
    assert levels == ["ERROR", "WARNING"], result["warned"]


# -- off, and the plugin's registration ------------------------------------------------------------------------


REGISTERED = """
import copy, json, threading
from kv_exporter.plugin import observe, register
register()
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache
model = torch.nn.Linear(2, 2)
caches = [DynamicCache(), copy.deepcopy(DynamicCache())]
observe.attach(model, [], torch.device("cpu"))
started = observe.start(lambda observation: None)
observation = observe.observe()
print(json.dumps({
    "patched": "__new__" in Cache.__dict__,
    "started": started,
    "threads": sum(thread.name == "kv-exporter-observe" for thread in threading.enumerate()),
    "state": observation.state.value,
    "interval": observation.interval_s,
    "tracked": sum(o.caches for o in observation.owners),
}))
"""


@pytest.mark.parametrize(
    ("interval", "expected"),
    [
        ("1", {"patched": True, "started": True, "threads": 1, "state": "ok", "interval": 1.0, "tracked": 2}),
        ("0", {"patched": False, "started": False, "threads": 0, "state": "off", "interval": 0.0, "tracked": 0}),
    ],
)
def test_the_plugin_patches_and_samples_only_when_observing(interval: str, expected: dict[str, object]) -> None:
    assert run_python(REGISTERED, KV_EXPORTER_OBSERVE_INTERVAL=interval) == expected


@pytest.mark.parametrize(
    ("text", "seconds", "warned"),
    [(None, DEFAULT_OBSERVE_INTERVAL_S, False), ("", DEFAULT_OBSERVE_INTERVAL_S, False), ("0", 0.0, False),
     ("1", 1.0, False), (" 2.5 ", 2.5, False), ("soon", DEFAULT_OBSERVE_INTERVAL_S, True),
     ("-1", DEFAULT_OBSERVE_INTERVAL_S, True), ("nan", DEFAULT_OBSERVE_INTERVAL_S, True),
     ("inf", DEFAULT_OBSERVE_INTERVAL_S, True)],
)  # fmt: skip
def test_the_interval_setting(text: str | None, seconds: float, warned: bool, caplog: pytest.LogCaptureFixture) -> None:
    forget_warnings()
    environ = {} if text is None else {"KV_EXPORTER_OBSERVE_INTERVAL": text}
    for _ in range(2):
        parsed = HookSettings.from_environ(environ)
    assert parsed.observe_interval_s == seconds
    assert parsed.observing is (seconds > 0)
    assert warnings_logged(caplog, "KV_EXPORTER_OBSERVE_INTERVAL") == int(warned)


# -- the thread ---------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("observer")
def test_the_sampler_thread_publishes_observations_until_stopped() -> None:
    model, cache = model_and_cache()
    observe.attach(model, [], torch.device("cpu"))
    received: list[Observation] = []
    arrived = threading.Event()

    def on_sample(observation: Observation) -> None:
        received.append(observation)
        arrived.set()

    assert observe.start(on_sample)
    assert observe.start(on_sample)  # idempotent: still one thread
    assert [thread.name for thread in threading.enumerate()].count(THREAD_NAME) == 1
    assert arrived.wait(120), "no observation within 120 s at a 1 s interval"
    observe.stop()
    assert THREAD_NAME not in {thread.name for thread in threading.enumerate()}
    first = received[0]
    assert (first.state, first.interval_s, first.cuda) == (ObservationState.OK, 1.0, None)
    assert first.cuda_unavailable is CudaUnavailable.NOT_CUDA  # a CPU worker: said, not left blank
    assert by_owner(first)[UNATTRIBUTED_OWNER].bytes == measure_cache_bytes(cache).allocated_bytes
    assert first.taken_at > 0 and first.duration_s > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("observer")
def test_on_a_cuda_device_the_allocator_figures_come_with_the_caches() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model = build(Qwen2ForCausalLM, full_config(), torch.float32).to(device)
    cache = DynamicCache()
    forward(model, cache, input_ids=prompt(1, 7).to(device))
    observe.attach(model, [], device)
    observation = sample()
    assert observation.cuda is not None and observation.cuda_unavailable is None
    assert observation.cuda.allocated_bytes == torch.cuda.memory_allocated(device)
    assert observation.cuda.reserved_bytes == torch.cuda.memory_reserved(device)
    assert observation.cuda.peak_bytes == torch.cuda.max_memory_allocated(device)
    assert by_owner(observation)[UNATTRIBUTED_OWNER].bytes == measure_cache_bytes(cache).allocated_bytes
    # A burst freed before the next sample: the allocator's peak rose, so the high-water is exact, and unreset.
    before = torch.cuda.memory_allocated(device)
    burst = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    del burst
    after = sample()
    assert after.cuda is not None
    assert after.cuda.high_water_bytes == after.cuda.high_water_floor_bytes >= before + (64 << 20)
    assert after.cuda.peak_bytes == torch.cuda.max_memory_allocated(device) == after.cuda.high_water_bytes


@pytest.mark.usefixtures("observer")
def test_before_the_model_is_attached_the_allocator_figures_say_why_they_are_missing() -> None:
    observation = sample()
    assert (observation.cuda, observation.cuda_unavailable) == (None, CudaUnavailable.NOT_ATTACHED)
    observe.attach(model_and_cache()[0], [], torch.device("cpu"))
    assert sample().cuda_unavailable is CudaUnavailable.NOT_CUDA
