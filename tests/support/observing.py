"""Shared by the observation tests: a freshly patched transformers Cache per test, and small real models.

`observer` installs the tracker the way the plugin does (the post-import hook's patch, on the real
`transformers.cache_utils`) with a 1 s interval, and takes everything back afterwards, so each test starts with
no tracked cache and no warning logged. Samples are taken with `observe.observe(pause=...)`, in the test's thread.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import DynamicCache, MistralForCausalLM, StaticCache

from kv_exporter.observation import Observation, ObservationState, OwnerObservation
from kv_exporter.plugin import observe
from kv_exporter.plugin.collect import COLLECTOR_OURS, collect, to_declarations
from kv_exporter.plugin.hooks import install_post_import
from kv_exporter.plugin.settings import HookSettings
from kv_exporter.protocol import ModelLocalKVSpec
from tests.support.cache_models import build, declare, forward, full_config, prompt, sliding_config
from tests.support.plugin_state import forget_warnings, stop_observing

OBSERVE_LOGGER = "vllm.kv_exporter"


def settings(interval_s: float, peak: bool = True) -> HookSettings:
    return HookSettings(
        disabled=False,
        directory=Path("/nonexistent"),
        explicit_directory=True,
        collector="auto",
        observe_interval_s=interval_s,
        observe_peak=peak,
    )


def _observing(peak: bool) -> Iterator[None]:
    stop_observing()
    forget_warnings()
    gc.collect()  # caches of earlier tests that only a cycle still holds
    install_post_import(observe.patches(settings(1.0, peak)))
    try:
        yield
    finally:
        stop_observing()
        forget_warnings()


@pytest.fixture
def observer() -> Iterator[None]:
    """Observation as it runs by default: the high-water mark between samples followed."""
    yield from _observing(peak=True)


@pytest.fixture
def observer_at_sample() -> Iterator[None]:
    """Observation with the peak not followed (KV_EXPORTER_OBSERVE_PEAK=0): the peak is the sample's figure, only a
    cache's creation hooked on the step path."""
    yield from _observing(peak=False)


def sample() -> Observation:
    """One sample, never pausing (the tests that check pausing pass their own)."""
    observation = observe.observe(pause=lambda: None)
    assert observation.state is ObservationState.OK, observation.reason
    return observation


def by_owner(observation: Observation) -> dict[str, OwnerObservation]:
    return {owner.owner: owner for owner in observation.owners}


def warnings_logged(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(
        1
        for record in caplog.records
        if record.name == OBSERVE_LOGGER and record.levelno == logging.WARNING and text in record.getMessage()
    )


# -- a small model with a declaring owner, an undeclared module and a cache made at load ------------------------


def decode_in_helper(codec: nn.Module, steps: int) -> DynamicCache:
    """A module-level helper a declarer's forward calls: the cache is made two frames below the forward."""
    return _prefill(codec, DynamicCache(config=codec.config), steps)


def _prefill(codec: nn.Module, cache: DynamicCache, steps: int) -> DynamicCache:
    forward(codec, cache, input_ids=prompt(1, 5))
    for _ in range(steps):
        forward(codec, cache, input_ids=prompt(1, 1))
    return cache


class Talker(nn.Module):
    """Declares its codec's cache, as vllm-omni's declarers do."""

    def __init__(self) -> None:
        super().__init__()
        self.codec = build(MistralForCausalLM, sliding_config(), torch.float32)
        self.caches: list[DynamicCache] = []

    def model_local_kv_specs(self) -> list[ModelLocalKVSpec]:
        config = self.codec.config
        return [declare(config, torch.float32, config.sliding_window - 1, "sliding_window - 1")]

    def forward(self, steps: int) -> None:
        self.caches.append(decode_in_helper(self.codec, steps))


class Vocoder(nn.Module):
    """Declares nothing; its language model makes its cache inside `generate`."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = build(MistralForCausalLM, sliding_config(), torch.float32)
        self.caches: list[object] = []

    def forward(self, new_tokens: int) -> None:
        with torch.no_grad():
            out = self.lm.generate(
                input_ids=prompt(1, 4),
                attention_mask=torch.ones(1, 4, dtype=torch.long),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        self.caches.append(out.cache if getattr(out, "cache", None) is not None else out.past_key_values)


class Omni(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.talker = Talker()
        self.vocoder = Vocoder()

    def forward(self, steps: int) -> None:
        self.talker(steps)
        self.vocoder(steps)


class PrebuiltStage(nn.Module):
    """Makes its cache while being built (a graph-pool cache, say): before the model is known."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = StaticCache(config=full_config(), max_cache_len=8)


class Prebuilt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([PrebuiltStage(), PrebuiltStage()])


def declaring_owners(model: nn.Module) -> list[str]:
    """The owners the manifest records for `model`: what the publisher passes to `attach`."""
    _, pairs = collect(model, COLLECTOR_OURS)
    return [declaration.owner for declaration in to_declarations(pairs)]
