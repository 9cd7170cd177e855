"""The observation as the hook publishes it: the first manifest already carries a sample, the sampler thread rewrites
the published manifests with each new one, and the sidecar reads back exactly what the caches hold."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from kv_exporter.cachebytes import measure_cache_bytes
from kv_exporter.manifest import Phase, read_manifest
from kv_exporter.observation import ObservationState
from kv_exporter.plugin import observe
from kv_exporter.plugin.publish import publish
from kv_exporter.plugin.settings import HookSettings
from kv_exporter.sidecar.liveness import State, Verdict
from kv_exporter.sidecar.observed import observe as sidecar_view
from kv_exporter.sidecar.records import GpuResult, ManifestEntry
from tests.support.observing import Omni, by_owner, observer
from tests.support.plugin_state import stop_observing

__all__ = ["observer"]  # the fixture, used by name

WAIT_S = 20.0


def engine_runner(model: torch.nn.Module) -> SimpleNamespace:
    return SimpleNamespace(
        model=model,
        device=torch.device("cpu"),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        model_config=SimpleNamespace(served_model_name=["omni"], model="/m"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )


def held(caches: list[object]) -> int:
    return sum(measure_cache_bytes(cache).allocated_bytes for cache in caches)


def test_the_published_manifest_carries_each_new_observation(tmp_path: Path, observer: None) -> None:
    model = Omni()
    model(2)  # caches made before the manifest is published (during load, say)
    settings = HookSettings(False, tmp_path, True, "kv_exporter", observe_interval_s=1.0)
    path = publish(engine_runner(model), Phase.LOAD, settings)
    assert path is not None
    first = read_manifest(path)
    assert first.observation is not None and first.observation.state is ObservationState.OK
    assert by_owner(first.observation)["talker"].bytes == held(model.talker.caches)
    model(3)  # two more caches, one per owner, while the engine serves
    deadline = time.monotonic() + WAIT_S
    while json.loads(path.read_text())["observation"]["taken_at"] == first.observation.taken_at:
        assert time.monotonic() < deadline, "the sampler never rewrote the manifest"
        time.sleep(0.1)
    renewed = read_manifest(path)
    assert renewed.observation is not None
    talker, vocoder = by_owner(renewed.observation)["talker"], by_owner(renewed.observation)["vocoder.lm"]
    assert (talker.bytes, talker.caches) == (held(model.talker.caches), 2)
    assert (vocoder.bytes, vocoder.caches) == (held(model.vocoder.caches), 2)
    assert renewed.declarations == first.declarations and renewed.written_at > first.written_at
    # The sidecar's figures are the worker's, to the byte: declared talker, undeclared vocoder.
    entry = ManifestEntry(str(path), renewed, Verdict(State.LIVE, "test"))
    views = {v.owner: v for v in sidecar_view([entry], {}, GpuResult(False, None), time.time()).owners}
    assert views["talker"].observed_bytes == talker.bytes and views["talker"].declares
    # generate() runs in the vocoder's language model, which declares nothing: the module that made the cache.
    assert views["vocoder.lm"].unexplained_bytes == vocoder.bytes and not views["vocoder.lm"].declares
    observe.stop()


def test_with_observation_off_the_manifest_says_so(tmp_path: Path) -> None:
    stop_observing()
    settings = HookSettings(False, tmp_path, True, "kv_exporter", observe_interval_s=0.0)
    observe.patches(settings)  # what register() does with KV_EXPORTER_OBSERVE_INTERVAL=0
    try:
        path = publish(engine_runner(Omni()), Phase.LOAD, settings)
        assert path is not None
        observation = read_manifest(path).observation
        assert observation is not None and observation.state is ObservationState.OFF
        assert not observe.start(lambda _: None)  # and no thread runs
    finally:
        stop_observing()
