"""Declared bytes against what real transformers caches hold (issue 2, section 4b).

Each case builds a tiny random model from a config, runs a real forward or generate, declares the cache with
spec_from_hf_config on the same config, and compares the declaration with measure_cache_bytes. Expected
position counts come from the scenario (prompt length, decode steps, window, max_cache_len), never from the
cache being measured.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from transformers import (
    DynamicCache,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    StaticCache,
    WhisperForConditionalGeneration,
)

from kv_exporter.cachebytes import CacheBytes, measure_cache_bytes
from kv_exporter.dtypes import dtype_name
from tests.support.cache_models import (
    WINDOW,
    at_positions,
    build,
    declare,
    forward,
    full_config,
    generate_cache,
    hybrid_config,
    param_dtype,
    prefill_and_decode,
    prompt,
    qwen3_tts_codec_config,
    qwen3_tts_codec_spec,
    sliding_config,
    whisper_config,
    whisper_decode,
)

LONG_PROMPT = 13  # longer than the window, so the sliding layers truncate


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    value: torch.dtype = request.param
    return value


@pytest.fixture(params=[1, 3], ids=["batch1", "batch3"])
def batch(request: pytest.FixtureRequest) -> int:
    value: int = request.param
    return value


def layer_kinds(measured: CacheBytes) -> set[str]:
    return {layer.kind for layer in measured.per_layer}


def positions_by_kind(measured: CacheBytes) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for layer in measured.per_layer:
        found.setdefault(layer.kind, set()).add(layer.positions)
    return found


# --- full DynamicCache ---------------------------------------------------------------------------------------


def test_full_dynamic_cache_from_generate(dtype: torch.dtype, batch: int) -> None:
    config = full_config()
    model = build(Qwen2ForCausalLM, config, dtype)
    prompt_len, new_tokens = 10, 5
    cache = generate_cache(model, batch, prompt_len, new_tokens)
    # generate feeds every token but the last one it produced back through the model
    held = prompt_len + new_tokens - 1
    spec = declare(config, param_dtype(model), held, "prompt + new tokens - 1")

    measured = measure_cache_bytes(cache)

    assert layer_kinds(measured) == {"DynamicLayer"}
    assert measured.shown_bytes == spec.peak_bytes(batch)
    assert measured.allocated_bytes == measured.shown_bytes  # torch.cat makes a fresh, exact tensor per step
    assert measured.layers == measured.allocated_layers == config.num_hidden_layers


# --- sliding-window DynamicCache: declared == shown, and the allocated gap with its exact figure ----------------


def test_sliding_layer_right_after_prefill_holds_every_prompt_position(dtype: torch.dtype, batch: int) -> None:
    config = sliding_config(WINDOW)
    model = build(MistralForCausalLM, config, dtype)
    cache = prefill_and_decode(model, DynamicCache(config=config), batch, LONG_PROMPT, decode_steps=0)
    spec = declare(config, param_dtype(model), config.sliding_window - 1, "sliding_window - 1")

    measured = measure_cache_bytes(cache)

    assert positions_by_kind(measured) == {"DynamicSlidingWindowLayer": {WINDOW - 1}}
    assert measured.shown_bytes == spec.peak_bytes(batch)
    # the view shows window-1 positions, but its storage is the whole P-token prefill
    assert measured.allocated_bytes == at_positions(spec, LONG_PROMPT).peak_bytes(batch)
    gap = at_positions(spec, LONG_PROMPT - (WINDOW - 1)).peak_bytes(batch)
    assert measured.allocated_bytes - spec.peak_bytes(batch) == gap == measured.unshown_bytes


def test_sliding_layer_after_decode_holds_a_whole_window(dtype: torch.dtype, batch: int) -> None:
    config = sliding_config(WINDOW)
    model = build(MistralForCausalLM, config, dtype)
    cache = generate_cache(model, batch, LONG_PROMPT, new_tokens=4)  # the cache generate builds itself
    spec = declare(config, param_dtype(model), config.sliding_window - 1, "sliding_window - 1")

    measured = measure_cache_bytes(cache)

    assert positions_by_kind(measured) == {"DynamicSlidingWindowLayer": {WINDOW - 1}}
    assert measured.shown_bytes == spec.peak_bytes(batch)
    # each decode step concatenates window-1 kept positions with the new one: storage of a whole window
    assert measured.allocated_bytes == at_positions(spec, WINDOW).peak_bytes(batch)
    assert measured.unshown_bytes == at_positions(spec, 1).peak_bytes(batch)


@pytest.mark.parametrize("chunk", [2, 5])
def test_sliding_layer_after_a_chunk_holds_window_minus_one_plus_chunk(
    dtype: torch.dtype, batch: int, chunk: int
) -> None:
    config = sliding_config(WINDOW)
    model = build(MistralForCausalLM, config, dtype)
    cache = prefill_and_decode(model, DynamicCache(config=config), batch, LONG_PROMPT, decode_steps=1)
    forward(model, cache, input_ids=prompt(batch, chunk))  # a multi-token step, as a chunked decoder feeds
    spec = declare(config, param_dtype(model), config.sliding_window - 1, "sliding_window - 1")

    measured = measure_cache_bytes(cache)

    assert measured.shown_bytes == spec.peak_bytes(batch)
    assert measured.allocated_bytes == at_positions(spec, WINDOW - 1 + chunk).peak_bytes(batch)
    assert measured.unshown_bytes == at_positions(spec, chunk).peak_bytes(batch)


def test_deep_copy_of_a_sliding_cache_copies_the_whole_storage(dtype: torch.dtype, batch: int) -> None:
    config = sliding_config(WINDOW)
    model = build(MistralForCausalLM, config, dtype)
    cache = prefill_and_decode(model, DynamicCache(config=config), batch, LONG_PROMPT, decode_steps=1)
    spec = declare(config, param_dtype(model), config.sliding_window - 1, "sliding_window - 1")

    working_copy = measure_cache_bytes(copy.deepcopy(cache))  # what a per-step working copy costs

    assert working_copy.shown_bytes == spec.peak_bytes(batch)
    assert working_copy.allocated_bytes == at_positions(spec, WINDOW).peak_bytes(batch)


def test_sliding_layer_below_the_window_shows_what_it_holds(dtype: torch.dtype, batch: int) -> None:
    config = sliding_config(WINDOW)
    model = build(MistralForCausalLM, config, dtype)
    prompt_len, steps = 4, 2  # 6 positions < window - 1: nothing truncated yet
    cache = prefill_and_decode(model, DynamicCache(config=config), batch, prompt_len, steps)
    capacity = declare(config, param_dtype(model), config.sliding_window - 1, "sliding_window - 1")

    measured = measure_cache_bytes(cache)

    assert (
        measured.shown_bytes == measured.allocated_bytes == at_positions(capacity, prompt_len + steps).peak_bytes(batch)
    )
    assert measured.shown_bytes < capacity.peak_bytes(batch)  # the declaration is the physical capacity


def test_plain_dynamic_cache_on_a_sliding_model_builds_full_layers(dtype: torch.dtype, batch: int) -> None:
    config = sliding_config(WINDOW)
    model = build(MistralForCausalLM, config, dtype)
    cache = prefill_and_decode(model, DynamicCache(), batch, LONG_PROMPT, decode_steps=2)
    window_spec = declare(config, param_dtype(model), config.sliding_window - 1, "sliding_window - 1")

    measured = measure_cache_bytes(cache)

    # without config= the cache does not know the window: it keeps every position, beyond the declaration
    assert layer_kinds(measured) == {"DynamicLayer"}
    assert measured.shown_bytes == at_positions(window_spec, LONG_PROMPT + 2).peak_bytes(batch)
    assert measured.shown_bytes > window_spec.peak_bytes(batch)


def test_hybrid_sliding_and_full_layers(dtype: torch.dtype, batch: int) -> None:
    config = hybrid_config(WINDOW)
    model = build(Qwen2ForCausalLM, config, dtype)
    prompt_len, new_tokens = LONG_PROMPT, 3
    cache = generate_cache(model, batch, prompt_len, new_tokens)
    sliding_layers = config.layer_types.count("sliding_attention")
    full_layers = config.layer_types.count("full_attention")
    sliding = declare(config, param_dtype(model), WINDOW - 1, "sliding_window - 1", layers=sliding_layers)
    full = declare(config, param_dtype(model), prompt_len + new_tokens - 1, "tokens fed", layers=full_layers)

    measured = measure_cache_bytes(cache)

    assert positions_by_kind(measured) == {
        "DynamicSlidingWindowLayer": {WINDOW - 1},
        "DynamicLayer": {prompt_len + new_tokens - 1},
    }
    assert measured.shown_bytes == sliding.peak_bytes(batch) + full.peak_bytes(batch)
    assert measured.unshown_bytes == at_positions(sliding, 1).peak_bytes(batch)  # only sliding layers have a gap


# --- StaticCache ---------------------------------------------------------------------------------------------


def test_static_cache_allocates_each_layer_at_its_first_update(dtype: torch.dtype, batch: int) -> None:
    config = full_config()
    max_cache_len = 24
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    one_layer = declare(config, dtype, max_cache_len, "max_cache_len", layers=1)

    before = measure_cache_bytes(cache)
    shape = (batch, config.num_key_value_heads, 2, config.head_dim)
    cache.update(torch.ones(shape, dtype=dtype), torch.ones(shape, dtype=dtype), layer_idx=1)
    after_one = measure_cache_bytes(cache)

    assert (before.layers, before.allocated_layers, before.shown_bytes, before.allocated_bytes) == (
        config.num_hidden_layers,
        0,
        0,
        0,
    )
    assert after_one.allocated_layers == 1
    assert [layer.positions for layer in after_one.per_layer] == [0, max_cache_len, 0]
    assert after_one.shown_bytes == after_one.allocated_bytes == one_layer.peak_bytes(batch)


def test_static_cache_holds_max_cache_len_whatever_was_written(dtype: torch.dtype, batch: int) -> None:
    config = full_config()
    model = build(Qwen2ForCausalLM, config, dtype)
    max_cache_len = 24
    cache = prefill_and_decode(model, StaticCache(config=config, max_cache_len=max_cache_len), batch, 5, 2)
    spec = declare(config, param_dtype(model), max_cache_len, "max_cache_len")

    measured = measure_cache_bytes(cache)

    assert layer_kinds(measured) == {"StaticLayer"}
    assert measured.allocated_layers == config.num_hidden_layers
    assert measured.shown_bytes == measured.allocated_bytes == spec.peak_bytes(batch)


@pytest.mark.parametrize("max_cache_len", [24, 5], ids=["longer_than_window", "shorter_than_window"])
def test_static_sliding_layer_holds_min_of_window_and_max_cache_len(
    dtype: torch.dtype, batch: int, max_cache_len: int
) -> None:
    config = sliding_config(WINDOW)
    model = build(MistralForCausalLM, config, dtype)
    cache = prefill_and_decode(model, StaticCache(config=config, max_cache_len=max_cache_len), batch, 4, 3)
    held = min(config.sliding_window, max_cache_len)
    spec = declare(config, param_dtype(model), held, "min(sliding_window, max_cache_len)")

    measured = measure_cache_bytes(cache)

    assert positions_by_kind(measured) == {"StaticSlidingWindowLayer": {held}}
    # static layers copy in place: no gap, and a whole window (not window - 1) when max_cache_len reaches it
    assert measured.shown_bytes == measured.allocated_bytes == spec.peak_bytes(batch)


# --- EncoderDecoderCache (Whisper-like) ----------------------------------------------------------------------


def test_encoder_decoder_cache_self_and_cross_attention(dtype: torch.dtype, batch: int) -> None:
    config = whisper_config()
    model = build(WhisperForConditionalGeneration, config, dtype)
    decoder_prompt, steps = 4, 2
    cache = whisper_decode(model, batch, decoder_prompt, steps, dtype)
    decoder = {
        "layers": config.decoder_layers,
        "kv_heads": config.decoder_attention_heads,
        "head_dim": config.d_model // config.decoder_attention_heads,
    }
    self_attn = declare(config, param_dtype(model), decoder_prompt + steps, "decoder tokens fed", **decoder)
    cross_attn = declare(config, param_dtype(model), config.max_source_positions, "encoder frames", **decoder)

    measured = measure_cache_bytes(cache)

    def shown_under(prefix: str) -> int:
        return sum(layer.shown_bytes for layer in measured.per_layer if layer.path.startswith(prefix))

    assert measured.layers == measured.allocated_layers == 2 * config.decoder_layers
    assert shown_under("self_attention_cache.") == self_attn.peak_bytes(batch)
    assert shown_under("cross_attention_cache.") == cross_attn.peak_bytes(batch)
    assert (
        measured.shown_bytes == measured.allocated_bytes == self_attn.peak_bytes(batch) + cross_attn.peak_bytes(batch)
    )
    # WhisperConfig maps num_hidden_layers / num_key_value_heads to the *encoder*: without the overrides the
    # declaration describes the wrong stack
    naive = declare(config, param_dtype(model), decoder_prompt + steps, "decoder tokens fed")
    assert naive.bytes_per_row != self_attn.bytes_per_row


# --- the Qwen3-TTS figure from the design notes ---------------------------------------------------------------


def test_qwen3_tts_codec_declares_71_positions_and_allocates_72() -> None:
    reference = qwen3_tts_codec_spec()
    config = qwen3_tts_codec_config()
    model = build(MistralForCausalLM, config, torch.float32)
    assert dtype_name(param_dtype(model)) == dtype_name(reference.dtype)
    declared = declare(config, param_dtype(model), config.sliding_window - 1, "sliding_window - 1")
    assert declared.bytes_per_row == reference.bytes_per_row == 4_653_056  # design notes: 4.44 MiB per row

    after_prefill = measure_cache_bytes(prefill_and_decode(model, DynamicCache(config=config), 1, 80, 0))
    after_decode = measure_cache_bytes(prefill_and_decode(model, DynamicCache(config=config), 1, 80, 1))

    assert after_prefill.shown_bytes == after_decode.shown_bytes == reference.bytes_per_row
    assert after_prefill.allocated_bytes == at_positions(reference, 80).bytes_per_row
    assert after_decode.allocated_bytes == at_positions(reference, 72).bytes_per_row == 4_718_592
    assert after_decode.allocated_bytes - reference.bytes_per_row == 65_536  # one position of K and V, 8 layers


# --- measure_cache_bytes itself ------------------------------------------------------------------------------


def test_storage_shared_between_layers_is_counted_once() -> None:
    config = full_config()
    model = build(Qwen2ForCausalLM, config, torch.float32)
    cache = prefill_and_decode(model, DynamicCache(config=config), 1, 6, 0)
    before = measure_cache_bytes(cache)
    # what a KV-sharing model does: a later layer points at an earlier layer's tensors
    cache.layers[2].keys, cache.layers[2].values = cache.layers[0].keys, cache.layers[0].values

    after = measure_cache_bytes(cache)

    assert after.shown_bytes == before.shown_bytes
    assert after.allocated_bytes == before.allocated_bytes - before.per_layer[2].allocated_bytes
    assert after.per_layer[2].allocated_bytes == 0


def test_rejects_an_object_that_is_not_a_cache() -> None:
    with pytest.raises(TypeError, match="not a transformers cache"):
        measure_cache_bytes(object())


def test_importing_cachebytes_does_not_import_torch() -> None:
    code = "import sys, kv_exporter, kv_exporter.cachebytes; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr or "importing kv_exporter.cachebytes imported torch"
