"""Tiny randomly initialised transformers models and the cache scenarios the byte proofs run.

Nothing is downloaded: every model is built from a config here. Geometry is small enough that the whole
proof runs in seconds on two CPU cores, but head_dim, kv heads and layers all differ from each other so a
transposed factor cannot hide.

`python -m tests.support.cache_models` prints the figures docs/cache-bytes.md quotes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import (
    DynamicCache,
    EncoderDecoderCache,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

from kv_exporter.cachebytes import CacheBytes, measure_cache_bytes
from kv_exporter.protocol import ModelLocalKVScope, ModelLocalKVSpec, RowDriver, spec_from_hf_config
from kv_exporter.reference import QWEN3_TTS

VOCAB = 61
SEED = 1234
WINDOW = 8  # sliding window of the tiny sliding models

# One geometry for every decoder-only case: 3 layers, 2 KV heads of 24 (4 query heads), so a factor mix-up shows.
_DECODER_GEOMETRY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def full_config() -> Qwen2Config:
    """Qwen2 without sliding window: every layer is a full-attention layer."""
    return Qwen2Config(**_DECODER_GEOMETRY, use_sliding_window=False)


def sliding_config(window: int = WINDOW, **overrides: Any) -> MistralConfig:
    """Mistral-like: every layer slides over `window` positions."""
    return MistralConfig(**{**_DECODER_GEOMETRY, **overrides}, sliding_window=window)


def hybrid_config(window: int = WINDOW) -> Qwen2Config:
    """Qwen2 with sliding and full layers interleaved (3 sliding, 2 full)."""
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    geometry = {**_DECODER_GEOMETRY, "num_hidden_layers": len(layer_types)}
    return Qwen2Config(**geometry, use_sliding_window=True, sliding_window=window, layer_types=layer_types)


def whisper_config() -> WhisperConfig:
    """Whisper-like; encoder and decoder differ in layers and heads, so encoder naming would under-declare."""
    return WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=48,
        encoder_layers=2,
        encoder_attention_heads=4,
        decoder_layers=3,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=20,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )


def qwen3_tts_codec_spec() -> ModelLocalKVSpec:
    """The reference Qwen3-TTS codec-decoder declaration (71 positions = sliding_window 72 - 1)."""
    return next(spec for _, spec in QWEN3_TTS.declarations if spec.name == "codec_decoder_request_cache")


def qwen3_tts_codec_config() -> MistralConfig:
    """A sliding model with the reference codec decoder's KV geometry (8 layers x 16 KV heads x 64, window 72).

    hidden_size stays small: the KV geometry is set by heads and head_dim, so the weights stay tiny.
    """
    spec = qwen3_tts_codec_spec()
    return sliding_config(
        window=spec.physical_capacity_positions + 1,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.kv_heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        hidden_size=64,
    )


def build(model_class: type[PreTrainedModel], config: Any, dtype: torch.dtype) -> Any:
    """A randomly initialised model in eval mode, seeded so every run sees the same weights."""
    torch.manual_seed(SEED)
    return model_class(config).to(dtype).eval()


def param_dtype(model: Any) -> torch.dtype:
    """The dtype a declarer reads from its own module, as vllm-omni's declarers do."""
    dtype: torch.dtype = next(model.parameters()).dtype
    return dtype


def _cache_kwarg(model: Any) -> str:
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name warns); accept either version."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def forward(model: Any, cache: Any, **inputs: Any) -> Any:
    """One real forward pass that writes into `cache`."""
    with torch.no_grad():
        return model(**inputs, **{_cache_kwarg(model): cache}, use_cache=True)


def prompt(batch: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED + batch * 1000 + length)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def prefill_and_decode(model: Any, cache: Any, batch: int, prompt_len: int, decode_steps: int) -> Any:
    """Prefill `prompt_len` tokens, then feed `decode_steps` single tokens: what a generate loop does."""
    forward(model, cache, input_ids=prompt(batch, prompt_len))
    for step in range(decode_steps):
        forward(model, cache, input_ids=prompt(batch, 1) + step % 2)
    return cache


def generate_cache(model: Any, batch: int, prompt_len: int, new_tokens: int) -> Any:
    """Run a real `generate` and return the cache it built (sliding layers when the config slides)."""
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt(batch, prompt_len),
            attention_mask=torch.ones(batch, prompt_len, dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    assert out.sequences.shape == (batch, prompt_len + new_tokens)
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def whisper_features(config: WhisperConfig, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """Log-mel-shaped input: the encoder's two convolutions halve 2 x max_source_positions frames."""
    generator = torch.Generator().manual_seed(SEED + batch)
    frames = 2 * config.max_source_positions
    return torch.randn(batch, config.num_mel_bins, frames, generator=generator).to(dtype)


def whisper_decode(model: Any, batch: int, decoder_prompt: int, decode_steps: int, dtype: torch.dtype) -> Any:
    """Encode once, prefill `decoder_prompt` decoder tokens, then decode single tokens."""
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    out = forward(
        model,
        cache,
        input_features=whisper_features(model.config, batch, dtype),
        decoder_input_ids=prompt(batch, decoder_prompt),
    )
    for _ in range(decode_steps):
        forward(model, cache, encoder_outputs=(out.encoder_last_hidden_state,), decoder_input_ids=prompt(batch, 1))
    return cache


def declare(config: Any, dtype: torch.dtype, positions: int, source: str, **geometry: int) -> ModelLocalKVSpec:
    """The declaration a model would publish for this cache: spec_from_hf_config on the same config."""
    return spec_from_hf_config(
        config,
        name="test_cache",
        physical_capacity_positions=positions,
        capacity_source=source,
        scope=ModelLocalKVScope.REQUEST,
        dtype=dtype,
        rows=RowDriver.MAX_NUM_SEQS,
        **geometry,
    )


def at_positions(spec: ModelLocalKVSpec, positions: int) -> ModelLocalKVSpec:
    """The same geometry at another position count: what the storage behind a declaration really holds."""
    return replace(spec, physical_capacity_positions=positions)


@dataclass(frozen=True)
class Figure:
    """One measured row for docs/cache-bytes.md."""

    case: str
    dtype: torch.dtype
    batch: int
    declared: int
    measured: CacheBytes


def _full_generate(dtype: torch.dtype, batch: int) -> tuple[int, Any]:
    config = full_config()
    cache = generate_cache(build(Qwen2ForCausalLM, config, dtype), batch, 10, 5)
    return declare(config, dtype, 10 + 5 - 1, "tokens fed").peak_bytes(batch), cache


def _sliding(prompt_len: int, steps: int, chunk: int = 0) -> Any:
    def run(dtype: torch.dtype, batch: int) -> tuple[int, Any]:
        config = sliding_config()
        model = build(MistralForCausalLM, config, dtype)
        cache = prefill_and_decode(model, DynamicCache(config=config), batch, prompt_len, steps)
        if chunk:
            forward(model, cache, input_ids=prompt(batch, chunk))
        return declare(config, dtype, WINDOW - 1, "sliding_window - 1").peak_bytes(batch), cache

    return run


def _static(sliding: bool, max_cache_len: int) -> Any:
    def run(dtype: torch.dtype, batch: int) -> tuple[int, Any]:
        config = sliding_config() if sliding else full_config()
        model = build(MistralForCausalLM if sliding else Qwen2ForCausalLM, config, dtype)
        cache = prefill_and_decode(model, StaticCache(config=config, max_cache_len=max_cache_len), batch, 4, 3)
        held = min(WINDOW, max_cache_len) if sliding else max_cache_len
        return declare(config, dtype, held, "static capacity").peak_bytes(batch), cache

    return run


def _whisper(dtype: torch.dtype, batch: int) -> tuple[int, Any]:
    config = whisper_config()
    cache = whisper_decode(build(WhisperForConditionalGeneration, config, dtype), batch, 4, 2, dtype)
    decoder = {
        "layers": config.decoder_layers,
        "kv_heads": config.decoder_attention_heads,
        "head_dim": config.d_model // config.decoder_attention_heads,
    }
    self_attn = declare(config, dtype, 4 + 2, "decoder tokens fed", **decoder)
    cross_attn = declare(config, dtype, config.max_source_positions, "encoder frames", **decoder)
    return self_attn.peak_bytes(batch) + cross_attn.peak_bytes(batch), cache


def _qwen3_tts(steps: int) -> Any:
    def run(dtype: torch.dtype, batch: int) -> tuple[int, Any]:
        config = qwen3_tts_codec_config()
        cache = prefill_and_decode(
            build(MistralForCausalLM, config, dtype), DynamicCache(config=config), batch, 80, steps
        )
        return declare(config, dtype, config.sliding_window - 1, "sliding_window - 1").peak_bytes(batch), cache

    return run


CASES = (
    ("full DynamicCache, generate 10 + 5 (14 held)", _full_generate),
    (f"sliding W={WINDOW}, right after a 13-token prefill", _sliding(13, 0)),
    (f"sliding W={WINDOW}, 13-token prefill + 3 decode steps", _sliding(13, 3)),
    (f"sliding W={WINDOW}, 13-token prefill + 1 step + a 5-token chunk", _sliding(13, 1, chunk=5)),
    (f"sliding W={WINDOW}, 4-token prefill + 2 steps (below window)", _sliding(4, 2)),
    ("StaticCache max_cache_len=24 (7 written)", _static(False, 24)),
    (f"static sliding W={WINDOW}, max_cache_len=24", _static(True, 24)),
    (f"static sliding W={WINDOW}, max_cache_len=5", _static(True, 5)),
    ("EncoderDecoderCache: 6 decoder + 20 encoder positions", _whisper),
    ("Qwen3-TTS codec geometry, 80-token prefill", _qwen3_tts(0)),
    ("Qwen3-TTS codec geometry, 80-token prefill + 1 step", _qwen3_tts(1)),
)


def figures(dtype: torch.dtype, batch: int) -> list[Figure]:
    """Measure every doc scenario; tests/torch/test_cachebytes.py asserts the same arithmetic."""
    rows = []
    for case, run in CASES:
        declared, cache = run(dtype, batch)
        rows.append(Figure(case, dtype, batch, declared, measure_cache_bytes(cache)))
    return rows


def main() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 3):
            print(f"\n{str(dtype).removeprefix('torch.')}, batch {batch}\n")
            print("| case | declared B | shown B | allocated B | allocated - declared B |")
            print("|---|---:|---:|---:|---:|")
            for row in figures(dtype, batch):
                m = row.measured
                print(
                    f"| {row.case} | {row.declared:,} | {m.shown_bytes:,} | {m.allocated_bytes:,} | "
                    f"{m.allocated_bytes - row.declared:,} |"
                )


if __name__ == "__main__":
    main()
