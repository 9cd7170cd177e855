"""The engine side of "observed beside declared": every live transformers cache, what it holds, who owns it.

Real transformers caches and models (tiny, random, built from configs). Every expected byte count comes from
`measure_cache_bytes` on the same cache (itself checked against declarations in tests/torch/test_cachebytes.py), never
from the observation being tested.
"""

from __future__ import annotations

import copy
import gc
import sys
import threading
import weakref
from typing import Any

import pytest
import torch
from transformers import (
    DynamicCache,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    StaticCache,
    WhisperForConditionalGeneration,
)
from transformers.cache_utils import DynamicLayer

from kv_exporter.cachebytes import measure_cache_bytes
from kv_exporter.manifest import Declaration
from kv_exporter.observation import UNATTRIBUTED_OWNER, ObservationState
from kv_exporter.plugin import observe
from tests.support.cache_models import (
    WINDOW,
    build,
    declare,
    forward,
    full_config,
    prefill_and_decode,
    prompt,
    sliding_config,
    whisper_config,
    whisper_decode,
)
from tests.support.observing import Omni, Prebuilt, by_owner, declaring_owners, decode_in_helper, observer, sample
from tests.support.plugin_state import stop_observing

__all__ = ["observer"]  # the fixture, imported for pytest

pytestmark = pytest.mark.usefixtures("observer")


def allocated(*caches: Any) -> int:
    return sum(measure_cache_bytes(cache).allocated_bytes for cache in caches)


def unattributed() -> tuple[int, int]:
    """(bytes, caches) of the caches made outside any module (these tests make theirs in the test function)."""
    found = by_owner(sample()).get(UNATTRIBUTED_OWNER)
    return (0, 0) if found is None else (found.bytes, found.caches)


# -- tracked from creation to release, measured as measure_cache_bytes measures ---------------------------------


def test_a_dynamic_cache_is_counted_while_it_lives_and_gone_once_released() -> None:
    model = build(Qwen2ForCausalLM, full_config(), torch.float32)
    cache = prefill_and_decode(model, DynamicCache(), batch=2, prompt_len=6, decode_steps=3)
    expected = allocated(cache)
    assert expected > 0
    assert unattributed() == (expected, 1)  # the forward passes made no cache of their own
    del cache
    gc.collect()
    assert unattributed() == (0, 0)


def test_a_sliding_cache_counts_the_whole_window_its_storage_holds() -> None:
    config = sliding_config()
    model = build(MistralForCausalLM, config, torch.float32)
    cache = prefill_and_decode(model, DynamicCache(config=config), batch=1, prompt_len=13, decode_steps=3)
    measured = measure_cache_bytes(cache)
    assert {layer.kind for layer in measured.per_layer} == {"DynamicSlidingWindowLayer"}
    assert {layer.positions for layer in measured.per_layer} == {WINDOW - 1}
    assert measured.allocated_bytes > measured.shown_bytes  # storage for a whole window behind a window - 1 view
    assert unattributed() == (measured.allocated_bytes, 1)


def test_a_static_cache_counts_nothing_before_its_lazy_allocation_and_everything_after() -> None:
    config = full_config()
    model = build(Qwen2ForCausalLM, config, torch.float32)
    cache = StaticCache(config=config, max_cache_len=24)
    assert all(layer.keys is None for layer in cache.layers)
    assert unattributed() == (0, 1)
    prefill_and_decode(model, cache, batch=1, prompt_len=4, decode_steps=2)
    assert allocated(cache) > 0
    assert unattributed() == (allocated(cache), 1)


def test_an_encoder_decoder_cache_is_one_cache_holding_both_halves() -> None:
    model = build(WhisperForConditionalGeneration, whisper_config(), torch.float32)
    cache = whisper_decode(model, batch=1, decoder_prompt=4, decode_steps=2, dtype=torch.float32)
    halves = (cache.self_attention_cache, cache.cross_attention_cache)
    assert all(allocated(half) > 0 for half in halves)
    assert unattributed() == (allocated(cache), 1)
    assert allocated(cache) == allocated(*halves)


def test_a_deep_copy_is_tracked_though_it_never_runs_init() -> None:
    model = build(Qwen2ForCausalLM, full_config(), torch.float32)
    cache = prefill_and_decode(model, DynamicCache(), batch=1, prompt_len=5, decode_steps=1)
    duplicate = copy.deepcopy(cache)
    assert allocated(duplicate) == allocated(cache)
    assert unattributed() == (2 * allocated(cache), 2)
    del cache
    gc.collect()
    assert unattributed() == (allocated(duplicate), 1)


def test_a_storage_two_caches_share_is_counted_once() -> None:
    model = build(Qwen2ForCausalLM, full_config(), torch.float32)
    cache = prefill_and_decode(model, DynamicCache(), batch=1, prompt_len=5, decode_steps=1)
    sharing = DynamicCache()
    sharing.layers = list(cache.layers)  # the same layer objects, so the same storages
    assert unattributed() == (allocated(cache), 2)


# -- attribution -------------------------------------------------------------------------------------------------


def test_a_cache_made_in_a_helper_a_declarer_calls_belongs_to_the_declarer() -> None:
    model = Omni()
    owners = declaring_owners(model)
    assert owners == ["talker"]
    observe.attach(model, owners)
    model(steps=2)
    found = by_owner(sample())
    (cache,) = model.talker.caches
    assert found["talker"].caches == 1
    assert found["talker"].bytes == allocated(cache) > 0


def test_an_undeclared_cache_names_the_module_that_made_it() -> None:
    model = Omni()
    observe.attach(model, declaring_owners(model))
    model(steps=2)
    found = by_owner(sample())
    (cache,) = model.vocoder.caches
    # generate() runs in the vocoder's language model, which declares nothing: the cache names that module
    assert found["vocoder.lm"].caches == 1
    assert found["vocoder.lm"].bytes == allocated(cache) > 0
    assert set(found) == {"talker", "vocoder.lm"}


def test_caches_made_before_attach_get_their_owner_once_the_model_is_known() -> None:
    model = Omni()
    model.talker.caches.append(decode_in_helper(model.talker.codec, 1))  # outside any forward: not the talker's
    model(steps=1)  # during "load": nobody knows the model yet
    before = by_owner(sample())
    assert set(before) == {UNATTRIBUTED_OWNER}
    assert before[UNATTRIBUTED_OWNER].caches == 3
    observe.attach(model, declaring_owners(model))
    after = by_owner(sample())
    outside, inside = model.talker.caches
    assert after["talker"].caches == 1
    assert after["talker"].bytes == allocated(inside)
    assert after["vocoder.lm"].caches == 1
    assert after[UNATTRIBUTED_OWNER].bytes == allocated(outside)


def test_a_cache_a_module_makes_while_being_built_is_attributed_after_attach() -> None:
    model = Prebuilt()  # each stage makes a StaticCache in its __init__: before anyone knows the model
    observe.attach(model, [])
    found = by_owner(sample())
    assert {owner: found[owner].caches for owner in found} == {"stages.0": 1, "stages.1": 1}


def test_a_cache_made_in_a_thread_of_its_own_is_unattributed() -> None:
    model = Omni()
    observe.attach(model, declaring_owners(model))
    made: list[DynamicCache] = []
    worker = threading.Thread(target=lambda: made.append(decode_in_helper(model.talker.codec, 1)))
    worker.start()
    worker.join()
    found = by_owner(sample())
    assert set(found) == {"talker", UNATTRIBUTED_OWNER}
    assert found["talker"].caches == 0  # a declarer holding nothing is there, with 0
    assert (found[UNATTRIBUTED_OWNER].bytes, found[UNATTRIBUTED_OWNER].caches) == (allocated(*made), 1)


TWIN_SOURCE = """
import torch
from transformers import DynamicCache

class Stage(torch.nn.Module):
    def forward(self):
        self.cache = DynamicCache()
"""


def twin_stage(filename: str) -> type[torch.nn.Module]:
    """The same class source compiled from two files: the two `forward` code objects compare equal."""
    namespace: dict[str, Any] = {}
    exec(compile(TWIN_SOURCE, filename, "exec"), namespace)
    stage: type[torch.nn.Module] = namespace["Stage"]
    return stage


def test_methods_whose_code_compares_equal_still_name_their_own_modules() -> None:
    first, second = twin_stage("first_stage.py"), twin_stage("second_stage.py")
    assert first.forward.__code__ == second.forward.__code__
    model = torch.nn.ModuleDict({"a": first(), "b": second()})
    observe.attach(model, ["b"])
    model["a"]()
    model["b"]()
    found = by_owner(sample())
    assert (found["a"].caches, found["b"].caches) == (1, 1)


def test_a_second_attach_with_more_declarers_attributes_new_caches_to_them() -> None:
    model = Omni()
    observe.attach(model, declaring_owners(model))
    model.vocoder(new_tokens=1)
    # the vocoder now declares its language model's cache (the geometry its child's cache has)
    vocoder = Declaration.from_spec("vocoder", declare(model.vocoder.lm.config, torch.float32, 16, "the prompt"))
    observe.attach(model, [*declaring_owners(model), vocoder])
    model.vocoder(new_tokens=1)
    found = by_owner(sample())
    assert (found["vocoder.lm"].caches, found["vocoder"].caches) == (1, 1)


def test_a_released_model_leaves_new_caches_waiting_for_the_next_one() -> None:
    model = Omni()
    observe.attach(model, declaring_owners(model))
    del model
    gc.collect()
    replacement = Omni()
    replacement(steps=1)
    # not attributed through the released model's map (whose module ids the new modules may well reuse)
    assert set(by_owner(sample())) == {UNATTRIBUTED_OWNER}
    observe.attach(replacement, declaring_owners(replacement))
    assert by_owner(sample())["talker"].caches == 1


def test_observation_paused_and_resumed_keeps_its_ledger_and_its_owners() -> None:
    """A worker pausing observation (the registry detached) and resuming it (the cache module patched again) keeps
    one ledger: caches from before are still counted, and new ones still find their modules."""
    model = Omni()
    observe.attach(model, declaring_owners(model))
    model(steps=1)
    before = by_owner(sample())["talker"]
    observe._observer.registry.detach()
    observe.patch_cache_module(sys.modules[observe.CACHE_MODULE])
    model(steps=1)
    after = by_owner(sample())["talker"]
    assert (after.caches, after.bytes) == (2 * before.caches, 2 * before.bytes)


def test_a_sample_holds_no_cache_while_it_pauses() -> None:
    keep = [DynamicCache() for _ in range(2000)]
    for layered in keep:
        layered.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 0)
    del layered
    released: list[weakref.ref[DynamicCache]] = []
    alive_at_pause: list[int] = []

    def pause() -> None:  # release every cache at the first pause: none may survive it
        if not released:
            released.extend(weakref.ref(cache) for cache in keep)
            keep.clear()
            alive_at_pause.append(sum(ref() is not None for ref in released))

    observation = observe.observe(pause=pause)
    assert released, "2,000 caches took less than one slice: nothing paused"
    assert alive_at_pause == [0]
    assert observation.state is ObservationState.OK
    assert sum(owner.caches for owner in observation.owners) < 2000  # those released at the pause are not counted


def test_a_storage_freed_and_its_address_reused_is_counted_again() -> None:
    """A cache released gives its storage up; a new storage at that address, the same size, is the new cache's. The
    address is reused for certain here: both storages are made over one buffer of this test's own."""
    buffer = bytearray(1152)

    def over_the_buffer() -> DynamicCache:
        cache = DynamicCache()
        cache.layers.append(DynamicLayer())
        cache.layers[0].keys = torch.frombuffer(buffer, dtype=torch.float32)
        return cache

    first = over_the_buffer()
    assert by_owner(sample())[UNATTRIBUTED_OWNER].bytes == len(buffer)
    del first  # its storage with it: the buffer outlives both
    second = over_the_buffer()
    found = by_owner(sample())[UNATTRIBUTED_OWNER]
    assert (found.bytes, found.caches) == (measure_cache_bytes(second).allocated_bytes, 1) == (len(buffer), 1)


def cache_doubled(x: torch.Tensor) -> torch.Tensor:
    cache = DynamicCache()
    keys, _ = cache.update(x, x, 0)
    return keys * 2


def test_code_that_makes_a_cache_still_compiles_with_fullgraph() -> None:
    """dynamo cannot trace the frame walk (sys._getframe): tracking must step aside while it traces."""
    x = torch.ones(1, 2, 3, 4)
    compiled = torch.compile(cache_doubled, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), cache_doubled(x))


def test_the_forward_passes_still_see_their_own_results() -> None:
    """Tracking changes nothing the model computes: the same logits with and without it."""
    model = build(Qwen2ForCausalLM, full_config(), torch.float32)
    tracked = forward(model, DynamicCache(), input_ids=prompt(1, 6)).logits
    stop_observing()
    untracked = forward(model, DynamicCache(), input_ids=prompt(1, 6)).logits
    assert torch.equal(tracked, untracked)
