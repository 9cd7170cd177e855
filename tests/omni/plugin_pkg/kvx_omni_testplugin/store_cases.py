"""The corpus's cases (kvx_omni_testplugin.corpus): what a built case is, and the raw K/V stores of vllm-omni modules
that declare nothing (rule 3, kv_exporter/plugin/observe/raw_stores.py), each module by its real `__init__` on a
real VllmConfig under a `bare` root of its real model class (whose own `__init__` needs a whole checkpoint)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvx_omni_testplugin import real_classes
from kvx_omni_testplugin.vllm_roots import vllm_config_for


@dataclass
class Built:
    """One model, built: its root, the steps a worker runs on it (none where no step can be driven on CPU), the raw
    K/V tensors it holds by upstream's own attributes, and how it was built (for the test's docstring)."""

    root: Any
    steps: list[Callable[[], Any]] = field(default_factory=list)
    raw_kv: Callable[[], list[Any]] = list
    how: str = ""
    raw_owner: str | None = None  # the module holding raw_kv when it declares nothing (rule 3)


def fast_ar(folder: Path, kind: str) -> Built:
    """A fast-AR residual-codebook predictor of 0.32.0rc1 (fish_speech or audio8_tts) by its real `__init__`, under
    a bare root of its real slow-AR class (whose real `__init__` needs the whole checkpoint), driven through its real
    forward: its `_ensure_buffers` keeps `_k_cache` / `_v_cache` [layers, batch, kv heads, codebooks + 1, head
    size] between calls, and it declares nothing. Tiny sizes, the checkpoints' relations (4 heads to 2 KV heads)."""
    import torch
    from transformers import Qwen2Config

    vllm_config = vllm_config_for(folder, Qwen2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=1))
    if kind == "fish_speech":
        from vllm_omni.model_executor.models.fish_speech.configuration_fish_speech import (
            FishSpeechFastARConfig,
            FishSpeechSlowARConfig,
        )
        from vllm_omni.model_executor.models.fish_speech.fish_speech_fast_ar import FishSpeechFastAR as FastAR
        from vllm_omni.model_executor.models.fish_speech.fish_speech_slow_ar import (
            FishSpeechSlowARForConditionalGeneration as Root,
        )

        heads = {"dim": 64, "n_head": 4, "n_local_heads": 2, "head_dim": 16, "intermediate_size": 128}
        slow = FishSpeechSlowARConfig(vocab_size=64, n_layer=2, semantic_begin_id=8, semantic_end_id=39, **heads)
        fast = FishSpeechFastARConfig(vocab_size=64, num_codebooks=4, n_layer=3, max_seq_len=5, **heads)
    else:
        from vllm_omni.model_executor.models.audio8_tts.audio8_tts_fast_ar import Audio8TTSFastAR as FastAR
        from vllm_omni.model_executor.models.audio8_tts.audio8_tts_slow_ar import (
            Audio8TTSSlowARForConditionalGeneration as Root,
        )
        from vllm_omni.model_executor.models.audio8_tts.configuration_audio8_tts import (
            Audio8TTSFastARConfig,
            Audio8TTSSlowARConfig,
        )

        slow = Audio8TTSSlowARConfig(
            vocab_size=64, dim=64, n_head=4, n_local_heads=2, head_dim=16, n_layer=2, intermediate_size=128,
            codebook_size=32, num_codebooks=4, semantic_begin_id=8, semantic_end_id=39,
        )  # fmt: skip
        fast = Audio8TTSFastARConfig(
            codebook_size=32, num_codebooks=4, fast_dim=64, fast_n_head=4, fast_n_local_heads=2, fast_head_dim=16,
            n_fast_layer=3, fast_intermediate_size=128,
        )  # fmt: skip
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    module = FastAR(vllm_config=vllm_config, config=fast, slow_ar_config=slow).eval()
    # What vLLM's loader does once the (here random) weights are in: CPU linears pick their kernel.
    process_weights_after_loading(module, vllm_config.model_config, torch.device("cpu"))
    root = real_classes.bare(Root, fast_ar=module)

    def step(batch: int) -> None:
        with torch.no_grad():
            module(torch.randn(batch, 64), torch.full((batch,), 9), do_sample=False)

    return Built(
        root,
        [lambda: step(1), lambda: step(3), lambda: step(2)],  # grows to 3 rows, then keeps them
        raw_kv=lambda: [t for t in (module._k_cache, module._v_cache) if t is not None],
        raw_owner="fast_ar",
        how=f"{kind} FastAR real __init__ on a real VllmConfig, bare root; 3 forwards of batch 1, 3, 2",
    )


def qwen3_code_predictor(folder: Path) -> Built:
    """Qwen3's fused code predictor (common/qwen3_code_predictor.py, 0.32.0rc1) by its real `__init__` with the
    options Qwen3-Omni's talker gives it, under a bare root of that talker. Its incremental K/V path is opt-in and
    CUDA-only (`code_predictor_kv_cache` and `is_cuda()`): set as such a platform sets it, its real `_ensure_buffers`
    allocates `_kv_buf` [layers, 2, batch, KV heads, code groups + 1, head size] beside its `_proj_buf`; the K/V
    forward itself is not driven (it needs CUDA)."""
    import torch
    from transformers import Qwen2Config, Qwen3Config
    from vllm_omni.model_executor.models.common.qwen3_code_predictor import (
        CodePredictorWrapper,
        CodePredictorWrapperConfig,
    )
    from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_moe_talker import (
        Qwen3OmniMoeTalkerForConditionalGeneration as Root,
    )

    vllm_config = vllm_config_for(folder, Qwen2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=1))
    cp_config = Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
        intermediate_size=128, vocab_size=32,
    )  # fmt: skip
    cp_config.num_code_groups = 4
    options = CodePredictorWrapperConfig(use_parallel_embedding=True, return_proj_buf=True, sampling_mode="stored")
    module = CodePredictorWrapper(
        vllm_config=vllm_config, cp_config=cp_config, wrapper_config=options, talker_hidden_size=64
    ).eval()
    root = real_classes.bare(Root, code_predictor=module)

    def allocate() -> None:
        module._kv_cache_enabled = True  # what a CUDA platform with code_predictor_kv_cache on gives
        module._ensure_buffers(torch.device("cpu"), torch.float32, 3)

    return Built(
        root,
        [allocate],
        raw_kv=lambda: [] if module._kv_buf is None else [module._kv_buf],
        raw_owner="code_predictor",
        how="CodePredictorWrapper real __init__ (Qwen3-Omni's options), bare talker root; _ensure_buffers, 3 rows",
    )


def qwen3_tts_frame_cache(folder: Path) -> Built:
    """Qwen3-TTS's talker code predictor (0.32.0rc1) by its real `__init__`, under a bare root of the real talker,
    with the FrameLocalKVCache its `_setup_compile` builds and keeps as `_frame_cache` when `code_predictor_kv_cache`
    is on and the platform is CUDA with bf16 weights (refused here: the cache is built as that method builds it, by
    its real class): a plain object holding `buffer` [layers, 2, batch, KV heads, code groups + 1, head size]."""
    from transformers import Qwen2Config
    from vllm_omni.model_executor.models.qwen3_tts.cached_code_predictor import FrameLocalKVCache
    from vllm_omni.model_executor.models.qwen3_tts.configuration_qwen3_tts import (
        Qwen3TTSTalkerCodePredictorConfig,
        Qwen3TTSTalkerConfig,
    )
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code_predictor_vllm import (
        Qwen3TTSTalkerCodePredictorForConditionalGenerationVLLM as Predictor,
    )
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker import Qwen3TTSTalkerForConditionalGeneration

    vllm_config = vllm_config_for(folder, Qwen2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=1))
    heads = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    predictor_config = Qwen3TTSTalkerCodePredictorConfig(
        vocab_size=32, num_hidden_layers=3, head_dim=16, num_code_groups=4, **heads
    )
    talker_config = Qwen3TTSTalkerConfig(
        code_predictor_config=predictor_config.to_dict(), vocab_size=64, num_hidden_layers=2, num_code_groups=4, **heads
    )
    module = Predictor(vllm_config=vllm_config, config=predictor_config, talker_config=talker_config).eval()
    root = real_classes.bare(Qwen3TTSTalkerForConditionalGeneration, code_predictor=module)

    def setup() -> None:
        weight = next(module.model.parameters())
        module._ensure_buffers(weight.device, weight.dtype, 3)  # as _setup_compile does, for its largest bucket
        module._frame_cache = FrameLocalKVCache(module.model, 3)

    return Built(
        root,
        [setup],
        raw_kv=lambda: [] if module._frame_cache is None else [module._frame_cache.buffer],
        raw_owner="code_predictor",
        how="Qwen3-TTS code predictor real __init__, bare talker root; FrameLocalKVCache as _setup_compile keeps it",
    )
