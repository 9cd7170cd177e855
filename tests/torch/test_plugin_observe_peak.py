"""The high-water mark between samples, attribution that cannot mask, and one bad cache costing only itself.

Real transformers caches in tiny random models. The expected peak is an independent count: the test itself sums the
storage behind every cache it holds (each storage once, by its own walk of `untyped_storage()`) after every
operation of a step, and takes the most. Storage only changes inside those operations and each one moves it one
way (an update or a copy only adds, a release only frees), so the most at their ends is the most at any instant.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn
from transformers import DynamicCache, MistralForCausalLM, Qwen2ForCausalLM, StaticCache
from transformers.cache_utils import Cache, DynamicLayer

from kv_exporter.manifest import Declaration
from kv_exporter.observation import UNATTRIBUTED_OWNER, ObservationState, UnreadableCaches, UnreadableReason
from kv_exporter.plugin import observe
from tests.support.cache_models import build, declare, forward, full_config, prompt, sliding_config
from tests.support.observing import by_owner, observer, sample

__all__ = ["observer"]  # the fixture, imported for pytest

pytestmark = pytest.mark.usefixtures("observer")


def storage_bytes(caches: Iterable[Any]) -> int:
    """The storage behind the caches' K and V, each storage once (by base pointer), walked here."""
    storages: dict[int, int] = {}
    for cache in caches:
        for layer in cache.layers:
            for tensor in (layer.keys, layer.values):
                if tensor is not None and tensor.untyped_storage().nbytes():
                    storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


class Probe:
    """The most the caches it is shown held, over the points it was shown them."""

    def __init__(self) -> None:
        self.most = 0

    def __call__(self, caches: Iterable[Any]) -> None:
        self.most = max(self.most, storage_bytes(caches))


def concatenated(caches: list[DynamicCache]) -> DynamicCache:
    """One batched cache from per-request ones, as a batching decoder builds it (new storage: torch.cat)."""
    batched = DynamicCache()
    for index in range(len(caches[0].layers)):
        keys = torch.cat([cache.layers[index].keys for cache in caches])
        values = torch.cat([cache.layers[index].values for cache in caches])
        batched.update(keys, values, index)
    return batched


class Decoder(nn.Module):
    """Declares nothing and holds nothing between steps: inside a step, per-request caches, their batched
    concatenation and a deep copy of it, all released when the step returns (Qwen3-TTS's eager async-chunk path)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = build(Qwen2ForCausalLM, full_config(), torch.float32)

    def forward(self, requests: int, probe: Callable[[Iterable[Any]], None]) -> None:
        caches: list[Any] = []
        for _ in range(requests):
            cache = DynamicCache()
            forward(self.lm, cache, input_ids=prompt(1, 5))
            caches.append(cache)
            probe(caches)
            forward(self.lm, cache, input_ids=prompt(1, 1))
            probe(caches)
        caches.append(concatenated(caches))
        probe(caches)
        caches.append(copy.deepcopy(caches[-1]))
        probe(caches)


class Parent(nn.Module):
    """Declares a cache of its own language model's geometry; its child `helper` declares nothing."""

    def __init__(self, helper: nn.Module) -> None:
        super().__init__()
        self.lm = build(MistralForCausalLM, sliding_config(), torch.float32)
        self.helper = helper
        self.kept: list[Any] = []

    def forward(self) -> None:
        self.kept.append(self.helper())


class Helper(nn.Module):
    """Makes its own cache (as MiMo's input_local_transformer does with use_cache on)."""

    def __init__(self, model_class: type[Any], config: Any) -> None:
        super().__init__()
        self.lm = build(model_class, config, torch.float32)

    def forward(self) -> DynamicCache:
        cache = DynamicCache()
        forward(self.lm, cache, input_ids=prompt(1, 4))
        return cache


def parent_declaration(model: Parent) -> Declaration:
    return Declaration.from_spec("", declare(model.lm.config, torch.float32, 8, "the window"))


# -- the high-water mark -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("requests", [1, 4])
def test_caches_made_and_freed_inside_steps_give_their_peak_to_the_byte(requests: int) -> None:
    model = nn.ModuleDict({"decoder": Decoder()})
    observe.attach(model, [])
    sample()  # the interval starts here
    probe = Probe()
    for _ in range(3):  # several steps inside one interval
        model["decoder"](requests, probe)
    gc.collect()
    found = by_owner(sample())["decoder"]
    assert (found.bytes, found.caches) == (0, 0)  # nothing between steps
    assert found.peak_bytes == probe.most > 0
    assert "decoder" not in by_owner(sample())  # the next interval saw nothing of it


def test_the_peak_counts_a_storage_two_caches_share_once() -> None:
    model = nn.ModuleDict({"decoder": Decoder()})
    observe.attach(model, [])
    probe = Probe()
    model["decoder"](2, probe)  # leaves nothing
    cache = DynamicCache()
    forward(model["decoder"].lm, cache, input_ids=prompt(1, 5))
    fork = copy.copy(cache)  # shares the layer objects and their tensors
    fork.layers = [copy.copy(layer) for layer in cache.layers]  # new layers, the same tensors
    del cache
    gc.collect()
    found = by_owner(sample())[UNATTRIBUTED_OWNER]
    assert found.bytes == storage_bytes([fork]) > 0  # still held by the fork's layers
    assert found.peak_bytes == found.bytes  # counted once while both lived


def test_a_static_cache_freed_after_its_segment_leaves_its_peak() -> None:
    model = build(MistralForCausalLM, sliding_config(), torch.float32)
    holder = nn.ModuleDict({"talker": nn.ModuleList([model])})
    observe.attach(holder, [])
    sample()

    def segment() -> int:
        cache = StaticCache(config=model.config, max_cache_len=16)
        forward(model, cache, input_ids=prompt(1, 6))
        return storage_bytes([cache])

    held = [segment() for _ in range(2)]
    gc.collect()
    found = by_owner(sample())[UNATTRIBUTED_OWNER]
    assert found.bytes == 0
    assert found.peak_bytes == max(held) > 0


def test_the_peak_is_never_below_what_the_sample_sees() -> None:
    model = build(Qwen2ForCausalLM, full_config(), torch.float32)
    cache = DynamicCache()
    forward(model, cache, input_ids=prompt(2, 7))
    found = by_owner(sample())[UNATTRIBUTED_OWNER]
    assert found.peak_bytes == found.bytes == storage_bytes([cache]) > 0


def test_the_next_interval_s_peak_starts_at_what_was_held_when_it_began() -> None:
    """Issue 39: after a session ended, the next interval's peak read below what its caches held at its start."""
    model = build(Qwen2ForCausalLM, full_config(), torch.float32)
    caches = [DynamicCache() for _ in range(3)]
    for length, made in zip((5, 7, 9), caches, strict=True):
        forward(model, made, input_ids=prompt(1, length))
    del made
    held = by_owner(sample())[UNATTRIBUTED_OWNER].bytes
    assert held == storage_bytes(caches) > 0
    del caches[1:]  # two of the three released within the next interval
    gc.collect()
    found = by_owner(sample())[UNATTRIBUTED_OWNER]
    assert (found.peak_bytes, found.bytes) == (held, storage_bytes(caches))


class OwnUpdate(DynamicCache):
    """A cache class defined after observation was installed, whose `update` fills its layers itself, never through
    `Cache.update` (as a model's own cache class may)."""

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        while len(self.layers) <= layer_idx:
            self.layers.append(DynamicLayer())
        return self.layers[layer_idx].update(key_states, value_states)


def test_a_cache_class_with_its_own_update_gives_its_peak() -> None:
    model = build(Qwen2ForCausalLM, full_config(), torch.float32)
    observe.attach(nn.ModuleDict({"lm": model}), [])
    sample()
    held = []
    for positions in (3, 9, 5):  # the largest in the middle: only the high-water mark keeps it
        cache = OwnUpdate()
        forward(model, cache, input_ids=prompt(1, positions))
        held.append(storage_bytes([cache]))
        del cache
    gc.collect()
    found = by_owner(sample())[UNATTRIBUTED_OWNER]
    assert found.bytes == 0
    assert found.peak_bytes == max(held) > 0


# -- attribution that cannot mask ----------------------------------------------------------------------------------


def test_an_undeclared_child_cache_of_another_shape_is_charged_to_the_child() -> None:
    other = full_config()
    other.head_dim = 16  # not the parent's declared geometry
    model = Parent(Helper(Qwen2ForCausalLM, other))
    observe.attach(model, [parent_declaration(model)])
    model()
    found = by_owner(sample())
    assert found["helper"].caches == 1
    assert found["helper"].bytes == storage_bytes(model.kept) > 0
    assert (found[""].bytes, found[""].caches) == (0, 0)  # the declarer holds nothing of it


def test_a_child_cache_of_the_declared_geometry_is_the_declarer_s() -> None:
    model = Parent(
        Helper(MistralForCausalLM, sliding_config())
    )  # the same KV heads, head size and dtype as the parent declares
    observe.attach(model, [parent_declaration(model)])
    model()
    found = by_owner(sample())
    assert "helper" not in found
    assert found[""].caches == 1
    assert found[""].bytes == storage_bytes(model.kept) > 0


class ModelMade(nn.Module):
    """Lets its language model make its cache (`use_cache`, as MiMo's input_local_transformer does): transformers
    builds it with every layer of the model's config."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.lm = build(MistralForCausalLM, config, torch.float32)

    def forward(self) -> Any:
        return self.lm(input_ids=prompt(1, 4), use_cache=True).past_key_values


def test_a_child_cache_with_other_layers_is_the_child_s_even_with_the_same_heads() -> None:
    model = Parent(ModelMade(sliding_config(num_hidden_layers=2)))  # the declared heads and size, 2 layers of 3
    observe.attach(model, [parent_declaration(model)])
    model()
    found = by_owner(sample())
    assert found["helper.lm.model"].caches == 1  # the module whose code made it, below the child
    assert found["helper.lm.model"].bytes == storage_bytes(model.kept) > 0
    assert (found[""].bytes, found[""].caches) == (0, 0)


def test_a_child_cache_with_the_declared_layers_is_the_declarer_s() -> None:
    model = Parent(ModelMade(sliding_config()))
    observe.attach(model, [parent_declaration(model)])
    model()
    found = by_owner(sample())
    assert found[""].caches == 1
    assert found[""].bytes == storage_bytes(model.kept) > 0


# -- one bad cache costs only itself ---------------------------------------------------------------------------------


class NoLayers(Cache):
    """A Cache subclass of its own keeping K and V its own way (as caches before transformers 4.56 did): no .layers."""

    def __init__(self) -> None:
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []


class PropertyLayers(DynamicCache):
    """Layers served by a property: observation reads a cache's own state, never code of its class (which could
    wait on a lock the model thread holds), so these are no layers it can see."""

    @property  # type: ignore[misc]
    def layers(self) -> list[Any]:
        raise RuntimeError("layers are not ready")

    @layers.setter
    def layers(self, value: list[Any]) -> None:
        pass


class SlottedLayer:
    """A layer without an instance dictionary: its K and V cannot be read."""

    __slots__ = ("keys", "values")


def slotted_layer_cache() -> DynamicCache:
    cache = DynamicCache()
    layer = SlottedLayer()
    layer.keys = layer.values = torch.zeros(1, 1, 1, 2)
    cache.layers.append(layer)
    return cache


def no_tensor_cache() -> DynamicCache:
    cache = DynamicCache()
    layer = DynamicLayer()
    layer.keys = [torch.zeros(1, 1, 1, 2)]  # a list, not a tensor
    cache.layers.append(layer)
    return cache


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (NoLayers, UnreadableReason.NO_LAYERS),
        (PropertyLayers, UnreadableReason.NO_LAYERS),
        (slotted_layer_cache, UnreadableReason.LAYERS_RAISED),
        (no_tensor_cache, UnreadableReason.NOT_A_TENSOR),
    ],
)
def test_an_unreadable_cache_is_left_out_and_counted_beside_good_ones(make: Callable[[], Any], reason: Any) -> None:
    model = build(Qwen2ForCausalLM, full_config(), torch.float32)
    good = [DynamicCache() for _ in range(2)]
    for cache in good:
        forward(model, cache, input_ids=prompt(1, 5))
    bad = make()
    observation = observe.observe(pause=lambda: None)
    assert observation.state is ObservationState.OK, observation.reason
    found = by_owner(observation)[UNATTRIBUTED_OWNER]
    assert (found.bytes, found.caches) == (storage_bytes(good), 2)
    assert observation.unreadable == (UnreadableCaches(UNATTRIBUTED_OWNER, reason, 1),)
    del bad
    gc.collect()
    assert sample().unreadable == ()


def test_a_tensor_without_storage_costs_only_its_cache() -> None:
    model = build(Qwen2ForCausalLM, full_config(), torch.float32)
    good, bad = DynamicCache(), DynamicCache()
    for cache in (good, bad):
        forward(model, cache, input_ids=prompt(1, 5))
    bad.layers[0].keys = bad.layers[0].keys.to_sparse()
    observation = sample()
    assert by_owner(observation)[UNATTRIBUTED_OWNER].bytes == storage_bytes([good])
    assert observation.unreadable == (UnreadableCaches(UNATTRIBUTED_OWNER, UnreadableReason.NO_STORAGE, 1),)


class StoragelessTensor(torch.Tensor):
    """A tensor subclass with a storage getter of its own, which has none to give (as a wrapper subclass's)."""

    def untyped_storage(self) -> Any:
        raise RuntimeError("this tensor keeps its data elsewhere")


def test_a_tensor_subclass_is_read_by_its_own_getter() -> None:
    """The tracker calls torch's storage getter directly, past Python: only on the type it found it on. A subclass
    defining its own is read through that one, after a plain tensor was read in the same sample."""
    model = build(Qwen2ForCausalLM, full_config(), torch.float32)
    good, bad = DynamicCache(), DynamicCache()
    for cache in (good, bad):
        forward(model, cache, input_ids=prompt(1, 5))
    bad.layers[-1].keys = bad.layers[-1].keys.as_subclass(StoragelessTensor)
    observation = sample()
    assert by_owner(observation)[UNATTRIBUTED_OWNER].bytes == storage_bytes([good])
    assert observation.unreadable == (UnreadableCaches(UNATTRIBUTED_OWNER, UnreadableReason.NO_STORAGE, 1),)


# -- what the lazy accounting must not miss -----------------------------------------------------------------------


def kv(positions: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `positions` positions in the tiny models' geometry (2 KV heads of 24)."""
    return torch.randn(batch, 2, positions, 24), torch.randn(batch, 2, positions, 24)


def test_a_sliding_window_dropping_positions_keeps_the_peak_before_it() -> None:
    """A sliding layer's update can free storage (it keeps a view of the last window of a concatenation): the
    instant before it must be counted although the growth before it was only marked."""
    cache = DynamicCache(config=sliding_config(window=4))
    sample()
    held = []
    for positions in (10, 1, 1, 1):  # a prefill past the window, then decode steps that cut it back
        for layer in range(3):
            cache.update(*kv(positions), layer)
            held.append(storage_bytes([cache]))
    found = by_owner(sample())[UNATTRIBUTED_OWNER]
    assert found.bytes == storage_bytes([cache]) < max(held)
    assert found.peak_bytes == max(held)


def test_a_reshaped_cache_then_growth_elsewhere_gives_the_peak() -> None:
    """A cache reshaped (batch_select_indices: new, smaller storage) between two growths of another: both the
    instant before the reshape and the growth after it are exact."""
    shrinking, growing = DynamicCache(), DynamicCache()
    sample()
    held = []
    for layer in range(3):
        shrinking.update(*kv(6, batch=4), layer)
        held.append(storage_bytes([shrinking, growing]))
    shrinking.batch_select_indices(torch.tensor([0]))
    held.append(storage_bytes([shrinking, growing]))
    for step in range(3):
        for layer in range(3):
            growing.update(*kv(5 if step == 0 else 1), layer)
            held.append(storage_bytes([shrinking, growing]))
    found = by_owner(sample())[UNATTRIBUTED_OWNER]
    assert found.bytes == storage_bytes([shrinking, growing])
    assert found.peak_bytes == max(held) == held[2]  # before the reshape: 4 rows of 6 positions
    assert found.peak_bytes > found.bytes


def test_a_copy_filled_after_it_was_made_is_counted() -> None:
    """copy.deepcopy fills a new cache after its `__new__`, through no method of it: it is read at the next fall."""
    original = DynamicCache()
    for layer in range(3):
        original.update(*kv(7), layer)
    sample()
    copied = copy.deepcopy(original)
    held = storage_bytes([original, copied])
    del copied  # a fall: the instant before it holds both
    gc.collect()
    found = by_owner(sample())[UNATTRIBUTED_OWNER]
    assert found.bytes == storage_bytes([original])
    assert found.peak_bytes == held == 2 * found.bytes
