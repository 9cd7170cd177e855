"""Observation with the peak not followed (KV_EXPORTER_OBSERVE_PEAK=0): nothing but a cache's creation and release
is hooked on the step path, the manifest says so, and attribution still cannot mask.

The same tiny real models as the peak tests (`test_plugin_observe_peak`), so the two modes answer the same cases.
"""

from __future__ import annotations

import gc

import pytest
from torch import nn
from transformers import DynamicCache, MistralForCausalLM, Qwen2ForCausalLM
from transformers.cache_utils import Cache, DynamicLayer

from kv_exporter.plugin import observe
from kv_exporter.plugin.observe.wrappers import is_hook
from tests.support.cache_models import full_config, sliding_config
from tests.support.observing import by_owner, observer_at_sample, sample
from tests.torch.test_plugin_observe_peak import Decoder, Helper, Parent, Probe, parent_declaration, storage_bytes

__all__ = ["observer_at_sample"]  # the fixture, imported for pytest

pytestmark = pytest.mark.usefixtures("observer_at_sample")


def test_no_cache_method_is_hooked_and_the_sample_says_the_peak_is_not_followed() -> None:
    DynamicCache()  # the first instance of a class wraps its methods where peaks are followed
    for cls, name in ((Cache, "update"), (DynamicCache, "crop"), (DynamicLayer, "update")):
        assert not is_hook(vars(cls).get(name)), (cls, name)
    assert sample().peaks_followed is False


def test_caches_made_and_freed_inside_steps_leave_no_peak_claimed() -> None:
    model = nn.ModuleDict({"decoder": Decoder()})
    observe.attach(model, [])
    sample()
    probe = Probe()
    model["decoder"](2, probe)
    gc.collect()
    found = by_owner(sample()).get("decoder")
    assert probe.most > 0
    assert found is None or found.peak_bytes == found.bytes == 0  # the sample's figure, not a peak


def test_an_undeclared_child_cache_of_another_shape_is_still_the_child_s() -> None:
    other = full_config()
    other.head_dim = 16
    model = Parent(Helper(Qwen2ForCausalLM, other))
    observe.attach(model, [parent_declaration(model)])
    model()
    found = by_owner(sample())
    assert found["helper"].bytes == storage_bytes(model.kept) > 0
    assert (found[""].bytes, found[""].caches) == (0, 0)


def test_a_child_cache_of_the_declared_geometry_is_still_the_declarer_s() -> None:
    model = Parent(Helper(MistralForCausalLM, sliding_config()))
    observe.attach(model, [parent_declaration(model)])
    model()
    found = by_owner(sample())
    assert "helper" not in found
    assert found[""].bytes == storage_bytes(model.kept) > 0
