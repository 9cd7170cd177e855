"""The corpus's cases (kvx_omni_testplugin.corpus): what a built case is, and the raw K/V stores of vllm-omni modules
that declare nothing (rules 3 and 4, kv_exporter/plugin/observe/raw_stores.py), each module by its real `__init__`
(on a real VllmConfig where it needs one) under a `bare` root of its real model class (whose own `__init__` needs a
whole checkpoint)."""

from __future__ import annotations

import inspect
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


# -- rule 4: per-layer stores (names that say K/V, heads the modules name) -------------------------------------------


def personaplex(folder: Path) -> Built:
    """PersonaPlex's mimi codec (personaplex_mimi.py) under a bare root of its real Code2Wav (whose real `__init__`
    downloads the checkpoint): the codec `bare` (its real `__init__` loads the checkpoint's MimiModel), holding its two
    real `_MimiStreamingTransformer`s by their real `__init__` (tiny). Its `streaming_init` gives each transformer
    layer a `_RingKV` (`[2, rows, heads, context, head size]`, a plain object in the transformer's `_kv` list; the
    layers name the heads): 0.32.0rc1's Code2Wav allocates the decoder half only, for its session rows and a scratch
    row; 0.30.0's both halves, one row a codec."""
    from vllm_omni.model_executor.models.personaplex.personaplex_code2wav import PersonaPlexCode2Wav
    from vllm_omni.model_executor.models.personaplex.personaplex_mimi import (
        PersonaPlexMimiCodec,
        _MimiStreamingTransformer,
    )

    def transformer() -> Any:
        return _MimiStreamingTransformer(num_layers=2, dim=32, num_heads=2, context=8)

    codec = real_classes.bare(
        PersonaPlexMimiCodec, encoder_transformer=transformer(), decoder_transformer=transformer()
    )
    root = real_classes.bare(PersonaPlexCode2Wav, mimi=codec)
    decoder_only = "encode" in inspect.signature(PersonaPlexMimiCodec.streaming_init).parameters  # 0.32.0rc1
    halves = [codec.decoder_transformer] if decoder_only else [codec.encoder_transformer, codec.decoder_transformer]

    def start() -> None:
        for half in halves:  # what the codec's streaming_init does to its transformers
            half.streaming_init(3 if decoder_only else 1)

    return Built(
        root,
        [start],
        raw_kv=lambda: [ring.cache for half in halves for ring in half._kv or ()],
        how="PersonaPlex mimi transformers real __init__, bare codec and Code2Wav; streaming_init as the codec's",
    )


def moss_codec(folder: Path, version: int) -> Built:
    """MOSS-TTS's audio tokenizer (v1 audio_tokenizer.py, v2 audio_tokenizer_v2.py) by its real `__init__` from a
    tiny config, under a bare root of the real MossTTSCodecDecoder (whose real `__init__` reads a checkpoint), as
    `_build_codec` builds and the decoder keeps it (`_codec`). Its real `initialize_decoder_state_pool` (what a
    streaming session calls) gives each decoder attention a streaming state holding a ring cache (`[2, slots, heads,
    context, head size]`; the attention names `num_heads` and `embed_dim`) beside offsets and, in v2, the
    convolutions' streaming states."""
    from vllm_omni.model_executor.models.moss_tts.modeling_moss_tts_codec import MossTTSCodecDecoder

    block = {
        "module_type": "Transformer", "d_model": 16, "num_heads": 2, "num_layers": 1, "dim_feedforward": 32,
        "causal": True, "norm": "layer_norm", "positional_embedding": "rope", "max_period": 10000, "gating": "none",
        "layer_scale": 0.01, "conv_layout": True,
    }  # fmt: skip
    kwargs: dict[str, Any] = {
        "sampling_rate": 80,
        "downsample_rate": 4,
        "causal_transformer_context_duration": 1.0,
        "number_channels": 1,
        "encoder_kwargs": [
            {"module_type": "PatchedPretransform", "patch_size": 4},
            {**block, "input_dimension": 4, "output_dimension": 8},
        ],
        "decoder_kwargs": [
            {**block, "input_dimension": 8, "output_dimension": 4},
            {"module_type": "PatchedPretransform", "patch_size": 4},
        ],
        "quantizer_kwargs": {
            "input_dim": 8, "rvq_dim": 8, "output_dim": 8, "num_quantizers": 2, "codebook_size": 16,
            "codebook_dim": 4, "quantizer_type": "rlfq",
        },
    }  # fmt: skip
    if version == 1:
        from vllm_omni.model_executor.models.moss_tts.audio_tokenizer import (
            MossAudioTokenizerConfig,
            MossAudioTokenizerModel,
        )

        codec = MossAudioTokenizerModel(MossAudioTokenizerConfig(**kwargs)).eval()
    else:
        from vllm_omni.model_executor.models.moss_tts.audio_tokenizer_v2 import (
            MossAudioTokenizerModel as V2Model,
        )
        from vllm_omni.model_executor.models.moss_tts.configuration_moss_audio_tokenizer_v2 import (
            MossAudioTokenizerConfig as V2Config,
        )

        codec = V2Model(V2Config(**kwargs)).eval()
    root = real_classes.bare(MossTTSCodecDecoder, _codec=codec)

    def rings() -> list[Any]:
        states = [getattr(module, "_streaming_state", None) for module in codec.modules()]
        return [state.kv_cache.cache for state in states if getattr(state, "kv_cache", None) is not None]

    return Built(
        root,
        [lambda: codec.initialize_decoder_state_pool(2, 1)],  # two sessions' slots and a scratch slot
        raw_kv=rings,
        how=f"MOSS audio tokenizer v{version} real __init__, bare MossTTSCodecDecoder; initialize_decoder_state_pool",
    )


def fish_dac_kv_cache(folder: Path) -> Built:
    """fish_speech's DAC window transformer (dac_modules/transformer.py, as the codec's RVQ `post_module`) by its real
    `__init__` from a tiny ModelArgs, under bare roots of the real FishSpeechDACDecoder, DAC and quantizer. Its real
    `setup_caches` gives each attention a `KVCache` module (`k_cache` / `v_cache` buffers `[batch, KV heads,
    positions, head size]`; the attention names `n_local_heads` and `head_dim`), made after load. Neither wheel calls
    `setup_caches` (vllm-omni decodes without it): a store that would be seen, were it allocated."""
    from vllm_omni.model_executor.models.fish_speech.dac_modules.codec import DAC
    from vllm_omni.model_executor.models.fish_speech.dac_modules.rvq import DownsampleResidualVectorQuantize
    from vllm_omni.model_executor.models.fish_speech.dac_modules.transformer import (
        ModelArgs,
        WindowLimitedTransformer,
    )
    from vllm_omni.model_executor.models.fish_speech.fish_speech_dac_decoder import FishSpeechDACDecoder

    args = ModelArgs(block_size=16, n_layer=2, n_head=4, n_local_heads=2, dim=64, head_dim=16, intermediate_size=128)
    transformer = WindowLimitedTransformer(config=args, input_dim=64, window_size=8, causal=True).eval()
    quantizer = real_classes.bare(DownsampleResidualVectorQuantize, post_module=transformer)
    root = real_classes.bare(FishSpeechDACDecoder, _codec=real_classes.bare(DAC, quantizer=quantizer))

    def caches() -> list[Any]:
        found = [layer.attention.kv_cache for layer in transformer.layers]
        return [t for cache in found if cache is not None for t in (cache.k_cache, cache.v_cache)]

    return Built(
        root,
        [lambda: transformer.setup_caches(max_batch_size=3, max_seq_length=8)],
        raw_kv=caches,
        how="fish DAC WindowLimitedTransformer real __init__, bare decoder; its real setup_caches after load",
    )


def fish_dac_stream(folder: Path) -> Built:
    """0.32.0rc1's fish_speech DAC streaming state (dac_channels_last.py): the real DACStreamState and
    DACDecodeGraphs (`_capture_graphs` builds them on CUDA with `fish_speech_dac_stateful`; its graphs are not
    captured here), under a bare FishSpeechDACDecoder root holding the real window transformer in its bare codec (whose
    attention names the heads). Each transformer layer's K/V is allocated by the stream's real `kv` (float32, the
    `_window_transformer_kv` path) and `ring` (bfloat16, the `_window_transformer_ring` path) into `kv_tensors`, beside
    the convolutions' histories in `tensors`."""
    import torch
    from vllm_omni.model_executor.models.fish_speech.dac_channels_last import (
        ChannelsLastDACDecoder,
        DACDecodeGraphs,
        DACStreamState,
    )

    built = fish_dac_kv_cache(folder)
    root = built.root
    transformer = root._codec.quantizer.post_module
    decoder = ChannelsLastDACDecoder.__new__(ChannelsLastDACDecoder)  # its real __init__ reads a whole codec
    decoder.transformer = transformer
    stream = DACStreamState(3, max_window_frames=4)
    stream.history(0, 6, torch.zeros(1, 1, 64))  # a convolution's history, of the transformer's width
    root._graphs = DACDecodeGraphs(
        decoder, 4, (2, 4), max_padded_frames=16, max_batch=3, receptive_frames=0, stream=stream
    )
    attention = transformer.layers[0].attention
    window = transformer.window_size

    def allocate(dtype: torch.dtype) -> None:
        like = torch.zeros(1, dtype=dtype)
        for layer in range(len(transformer.layers)):
            if dtype == torch.float32:
                stream.kv(layer, window, attention.n_local_heads, attention.head_dim, like)
            else:
                stream.ring(layer, window, attention.n_local_heads, attention.head_dim, like)

    return Built(
        root,
        [lambda: allocate(torch.float32), lambda: allocate(torch.bfloat16)],
        raw_kv=lambda: list(stream.kv_tensors.values()),
        how="fish DAC DACStreamState, DACDecodeGraphs real classes, bare decoder; kv and ring as the codec calls them",
    )


def qwen3_tts_stream_decoder(folder: Path) -> Built:
    """0.32.0rc1's Qwen3-TTS in-stage streaming decoder (tokenizer_12hz/streaming_decoder.py): the real
    StreamingCodecDecoder, by its real `__init__` from the real Qwen3TTSTokenizerV2Decoder (tiny config, as the
    corpus's Qwen3-TTS cases build it), as the talker's `load_weights` builds it with `stream_decode` on (bfloat16,
    one slot a sequence), under a bare talker root. Its `layers` dicts hold `k_ring` / `v_ring` `[slots + 1, RING,
    heads x head size]` (it names `heads` and `head_dim`) beside convolution histories of the same kind of shape."""
    import torch
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker import Qwen3TTSTalkerForConditionalGeneration
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Decoder,
    )
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.streaming_decoder import StreamingCodecDecoder

    from kvx_omni_testplugin.upstream_peaks import MAX_NUM_SEQS, qwen3_tts_decoder_config

    # The released decoder config names its head size (the streaming decoder reads it); 2 heads of 16 here.
    decoder_config = {**qwen3_tts_decoder_config(), "head_dim": 16}
    config = Qwen3TTSTokenizerV2Config(decoder_config=decoder_config, output_sample_rate=24000)
    decoder = Qwen3TTSTokenizerV2Decoder._from_config(config.decoder_config).eval()
    stream = StreamingCodecDecoder(decoder, num_slots=MAX_NUM_SEQS, dtype=torch.bfloat16)
    root = real_classes.bare(Qwen3TTSTalkerForConditionalGeneration, stream_decoder=stream)
    return Built(
        root,
        raw_kv=lambda: [layer[name] for layer in stream.layers for name in ("k_ring", "v_ring")],
        how="StreamingCodecDecoder real __init__ from the real tokenizer decoder, bf16, bare talker root (at load)",
    )
