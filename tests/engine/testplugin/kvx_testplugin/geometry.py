"""The test architecture's cache geometry: one source for the plugin (in .venv-vllm) and the tests (in .venv).

No torch or vllm here: the engine tests import it from the main venv to compute what the manifest must say.
"""

from __future__ import annotations

ARCHITECTURE = "KvxTestForCausalLM"

# The side caches are built from a tiny transformers Qwen2: 2 layers, 4 heads, 2 KV heads, hidden 128.
SIDE_LAYERS = 2
SIDE_HEADS = 4
SIDE_KV_HEADS = 2
SIDE_HIDDEN = 128
SIDE_HEAD_DIM = SIDE_HIDDEN // SIDE_HEADS

DECODER_POSITIONS = 24  # kvx_talker.decoder: DynamicCache filled by a prefill of this many positions, fp32
ENCODER_CAPACITY = 40  # kvx_talker.encoder: StaticCache(max_cache_len=40), bf16
ENCODER_PREFILL = 8  # positions written into the StaticCache (it allocates max_cache_len at the first update)
LATE_POSITIONS = 4  # kvx_late: attached by the custom runner after super().load_model()

# Batch sizes the custom worker "captures" after super().compile_or_warm_up_model().
CAPTURE_SIZES = (1, 2, 4)

DECODER_OWNER = "kvx_talker.decoder"
ENCODER_OWNER = "kvx_talker.encoder"
TALKER_OWNER = "kvx_talker"
LATE_OWNER = "kvx_late"
