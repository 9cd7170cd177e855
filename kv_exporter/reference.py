"""Reference declarations of the four models in vllm-omni's design notes.

Shared by the tests (which assert the design notes' table to the byte) and the demo. Geometry that the notes do not
spell out is chosen from each model's published config so that the per-row figure matches the notes exactly; each
choice is stated in `capacity_source` / `allocation_note` and in docs/declarations.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_exporter.protocol import ModelLocalKVScope, ModelLocalKVSpec, RowDriver

# Qwen3-TTS captures its codec decoder for these batch sizes in this example; the real list comes from the
# deployment's captured shapes, which is why the graph pool is FIXED with the bucket sum as its reason.
QWEN3_TTS_EXAMPLE_CAPTURE_SIZES = (1, 2, 4, 8, 16)
# MiMo-Audio's captured bucket list sums to 261 rows (design notes).
MIMO_AUDIO_GRAPH_POOL_ROWS = 261


@dataclass(frozen=True)
class ReferenceModel:
    """One model: its served name, the owner paths inside it, and what each owner declares."""

    model_name: str
    declarations: tuple[tuple[str, ModelLocalKVSpec], ...]


def _qwen3_tts_codec(name: str, scope: ModelLocalKVScope, rows: RowDriver, **extra: object) -> ModelLocalKVSpec:
    return ModelLocalKVSpec(
        name=name,
        layers=8,
        kv_heads=16,
        head_dim=64,
        dtype="float32",
        physical_capacity_positions=71,
        capacity_source="sliding_window - 1 = 71 (sliding_window 72)",
        scope=scope,
        rows=rows,
        **extra,  # type: ignore[arg-type]
    )


QWEN3_TTS = ReferenceModel(
    model_name="Qwen3-TTS",
    declarations=(
        (
            "talker.code_predictor.codec_decoder",
            _qwen3_tts_codec(
                "codec_decoder_request_cache",
                ModelLocalKVScope.REQUEST,
                RowDriver.MAX_NUM_SEQS,
                allocation_note="async-chunk path only; one sliding DynamicCache per request, retained across chunks",
            ),
        ),
        (
            "talker.code_predictor.codec_decoder",
            _qwen3_tts_codec(
                "codec_decoder_working_copy",
                ModelLocalKVScope.INVOCATION,
                RowDriver.MAX_NUM_SEQS,
                allocation_note="per-step working copy living beside the retained cache",
            ),
        ),
        (
            "talker.code_predictor.codec_decoder",
            _qwen3_tts_codec(
                "codec_decoder_graph_pool",
                ModelLocalKVScope.MODEL,
                RowDriver.FIXED,
                rows_fixed=sum(QWEN3_TTS_EXAMPLE_CAPTURE_SIZES),
                rows_reason=f"sum of captured batch sizes {QWEN3_TTS_EXAMPLE_CAPTURE_SIZES} (example capture list)",
                allocation_note="one retained cache per captured bucket; a floor for the xvec path",
            ),
        ),
    ),
)

_MIMO_LOCAL = {
    "layers": 16,
    "kv_heads": 8,
    "head_dim": 128,
    "dtype": "bfloat16",
    "physical_capacity_positions": 11,
    "capacity_source": "group_size + max(delay_pattern) = 4 + 7 = 11 (decode-loop trip count)",
}

MIMO_AUDIO = ReferenceModel(
    model_name="MiMo-Audio",
    declarations=(
        (
            "local_transformer",
            ModelLocalKVSpec(
                name="local_transformer_cache",
                scope=ModelLocalKVScope.REQUEST,
                rows=RowDriver.MAX_NUM_SEQS,
                **_MIMO_LOCAL,  # type: ignore[arg-type]
            ),
        ),
        (
            "local_transformer",
            ModelLocalKVSpec(
                name="local_transformer_graph_pool",
                scope=ModelLocalKVScope.MODEL,
                rows=RowDriver.FIXED,
                rows_fixed=MIMO_AUDIO_GRAPH_POOL_ROWS,
                rows_reason="sum of the captured bucket sizes (261); no Python object holds it",
                allocation_note="captured in the constructor whenever CUDA is available, even under enforce_eager",
                **_MIMO_LOCAL,  # type: ignore[arg-type]
            ),
        ),
    ),
)

MINICPM_O = ReferenceModel(
    model_name="MiniCPM-o",
    declarations=(
        (
            "apm",
            ModelLocalKVSpec(
                name="whisper_encoder_cache",
                layers=24,
                kv_heads=16,
                head_dim=64,
                dtype="bfloat16",
                physical_capacity_positions=1500,
                capacity_source="embed_positions rows = 1500 (encoder frame limit)",
                scope=ModelLocalKVScope.SESSION,
                rows=RowDriver.FIXED,
                rows_fixed=1,
                rows_reason="one cache object per streaming session; the session cap is not visible to the model",
                allocation_note="streaming path only; EncoderDecoderCache, one per session",
            ),
        ),
    ),
)

MING_FLASH_OMNI = ReferenceModel(
    model_name="ming_flash_omni",
    declarations=(
        (
            "talker",
            ModelLocalKVSpec(
                name="talker_static_cache",
                layers=24,
                kv_heads=2,
                head_dim=64,
                dtype="bfloat16",
                physical_capacity_positions=2048,
                capacity_source="hardcoded max_cache_len = 2048",
                scope=ModelLocalKVScope.INVOCATION,
                rows=RowDriver.FIXED,
                rows_fixed=1,
                rows_reason="calls are serialized: forward runs the whole AR loop inline for one request",
                allocation_note="StaticCache rebuilt per call; geometry from the checkpoint's Qwen2Config",
            ),
        ),
    ),
)

REFERENCE_MODELS: tuple[ReferenceModel, ...] = (QWEN3_TTS, MIMO_AUDIO, MINICPM_O, MING_FLASH_OMNI)
