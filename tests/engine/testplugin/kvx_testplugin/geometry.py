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

# The second architecture (observed.py): four owners whose real caches live and die with the requests.
OBSERVED_ARCHITECTURE = "KvxObservedForCausalLM"
OBSERVED_PARENT = "kvx_observed"
TRUTHFUL_OWNER = f"{OBSERVED_PARENT}.truthful"  # declares max_num_seqs rows, holds one per running request
UNDER_OWNER = f"{OBSERVED_PARENT}.under"  # declares FIXED 1, holds one per running request
UNDECLARED_OWNER = f"{OBSERVED_PARENT}.undeclared"  # declares nothing, holds one per running request
NEVER_OWNER = f"{OBSERVED_PARENT}.never"  # declares max_num_seqs rows, never allocates
# Positions each holder's per-request DynamicCache is filled with once, at admission (fp32, the side geometry);
# distinct, so that no owner's bytes can pass for another's.
REQUEST_POSITIONS = {TRUTHFUL_OWNER: 16, UNDER_OWNER: 12, UNDECLARED_OWNER: 8}
NEVER_POSITIONS = 20
OBSERVED_ITEMSIZE = 4
# Declares nothing and holds nothing between steps: inside each step, one DynamicCache of STEP_POSITIONS per running
# request, their batched concatenation and a deep copy of it, all freed when the step returns (Qwen3-TTS's eager
# async-chunk decoder). Its peak in a step with n running requests: 3 x n caches' worth.
IN_STEP_OWNER = f"{OBSERVED_PARENT}.in_step"
STEP_POSITIONS = 6
