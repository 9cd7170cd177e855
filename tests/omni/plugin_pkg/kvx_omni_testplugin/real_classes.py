"""vllm-omni 0.32.0rc1's real model-local KV holders, built from small random configs, published by kv-exporter.

Run in .venv-omni32 only (these modules are new in 0.32.0rc1), one model per process:
    .venv-omni32/bin/python -m kvx_omni_testplugin.real_classes MODEL OUT_DIR
It installs kv-exporter's observation the way the plugin does (before transformers is imported), builds the model
(its owners through ``cls.__new__`` and ``nn.Module.__init__`` where the real ``__init__`` builds a vLLM engine or
loads weights by hub name), runs the real upstream code that allocates its KV, publishes the manifest through the
hook's own ``publish`` (a copy under ``OUT_DIR/published``) and writes ``OUT_DIR/held.json``: what the KV holders
really hold, counted here independently of kv-exporter (each tensor storage once, by its data pointer).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kv_exporter.manifest import Phase
from kv_exporter.plugin import observe
from kv_exporter.plugin.hooks import install_post_import
from kv_exporter.plugin.observe.holders import KNOWN_CLASSES, Holders
from kv_exporter.plugin.publish import publish
from kv_exporter.plugin.settings import HookSettings

MAX_NUM_SEQS = 4  # VibeVoice's negative pool takes 1-4


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind `tensors` (a view and its base count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def bare(cls: type, **attributes: Any) -> Any:
    """An instance of an nn.Module subclass without its real __init__, with the attributes given."""
    from torch import nn

    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    for name, value in attributes.items():
        setattr(obj, name, value)
    return obj


def vibevoice() -> tuple[Any, dict[str, Any]]:
    """VibeVoice's negative-CFG pool: the real VibeVoiceNegativeKV, its real __init__ and declaration."""
    import torch
    from transformers import Qwen2Config
    from vllm_omni.model_executor.models.vibevoice.negative_kv import VibeVoiceNegativeKV
    from vllm_omni.model_executor.models.vibevoice.vibevoice import VibeVoiceForConditionalGeneration

    text = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    vllm_config = SimpleNamespace(  # the fields VibeVoiceNegativeKV.__init__ reads
        model_config=SimpleNamespace(hf_config=text, max_model_len=100),
        cache_config=SimpleNamespace(block_size=16),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
    )
    layers = [SimpleNamespace(self_attn=SimpleNamespace(attn=None)) for _ in range(text.num_hidden_layers)]
    pool = VibeVoiceNegativeKV(language_model=SimpleNamespace(layers=layers), vllm_config=vllm_config)
    try:  # the real allocation, as load_weights calls it on this machine's (CPU) parameters
        pool.allocate(device=torch.device("cpu"), dtype=torch.bfloat16)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    # What allocate() does once its CUDA / FlashAttention 3 checks pass (negative_kv.py): one
    # [slots * pages, kv heads, block size, 2 * head dim] tensor per layer and an int32 [slots, pages] table.
    total = pool._max_slots * pool._blocks_per_slot
    shape = (total, pool._num_kv_heads, pool._block_size, 2 * pool._head_dim)
    pool._kv_caches = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(pool._num_layers)]
    pool._block_tables = torch.arange(total, dtype=torch.int32).reshape(pool._max_slots, pool._blocks_per_slot)
    pool._dtype = torch.bfloat16
    root = bare(VibeVoiceForConditionalGeneration, config=text, negative_kv=pool)
    held = {
        "kv_pool": storage_bytes(pool._kv_caches),
        "block_table": storage_bytes([pool._block_tables]),
        "cpu_allocate_refused": refused,
    }
    return root, held


def minicpmo() -> tuple[Any, dict[str, Any]]:
    """MiniCPM-o 4.5's batched streaming audio encoder: two sessions' StreamingAudioKVCache, made by the real
    thinker method the duplex runtime calls, on the real MiniCPMWhisperEncoder."""
    import torch
    from torch import nn
    from transformers import PretrainedConfig, WhisperConfig
    from vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni import MiniCPMO45OmniForConditionalGeneration
    from vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni_llm import (
        MiniCPMO45OmniLLMForConditionalGeneration,
        MiniCPMWhisperEncoder,
        MultiModalProjector,
    )
    from vllm_omni.model_executor.models.minicpmo_4_5.streaming_audio_encoder import StreamingAudioChunk

    torch.manual_seed(0)
    audio = WhisperConfig(
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        num_mel_bins=16,
        max_source_positions=1500,  # Whisper's: the declared capacity
    )
    audio._attn_implementation = "eager"
    pool_step = 2
    thinker = bare(
        MiniCPMO45OmniLLMForConditionalGeneration,
        config=PretrainedConfig(audio_pool_step=pool_step),
        apm=MiniCPMWhisperEncoder(audio).eval(),
        audio_avg_pooler=nn.AvgPool1d(pool_step, stride=pool_step),
        audio_projection_layer=MultiModalProjector(in_dim=audio.d_model, out_dim=32),
    )
    root = bare(MiniCPMO45OmniForConditionalGeneration, thinker=thinker)

    def unit(cache: Any) -> StreamingAudioChunk:
        return StreamingAudioChunk(torch.randn(audio.num_mel_bins, 40), cache, use_extra_context=False)

    _, first = thinker.get_audio_embedding_streaming_batch([unit(None), unit(None)])  # two new sessions
    _, later = thinker.get_audio_embedding_streaming_batch([unit(first[0])])  # the first one goes on
    sessions = [later[0], first[1]]
    root.sessions = sessions  # held as the duplex runtime holds them: by plain attributes of the stage
    held = {
        "sessions": len(sessions),
        "buffers": storage_bytes(session._buffer for session in sessions),
        "capacities": [session.capacity for session in sessions],
        "lengths": [session.length for session in sessions],
        "page_positions": sessions[0].page_positions,
    }

    def grow() -> dict[str, Any]:
        """After the first sample: the first session grows past its page (the real reserve: a larger buffer,
        allocated while the old one lives, the committed prefix copied, the old one dropped); then the CUDA-graph
        encoder's capture, which this CPU's torch refuses before allocating anything, and the buffers a capture
        leaves (built as `capture` builds them, handed to observation as a returning `capture` hands them)."""
        old = storage_bytes([sessions[0]._buffer])
        sessions[0].reserve(sessions[0].capacity + 1, dtype=sessions[0]._buffer.dtype, device=torch.device("cpu"))
        now = storage_bytes(session._buffer for session in sessions)
        result = {"grown_capacity": sessions[0].capacity, "grown_buffers": now, "grown_instant": now + old}
        graph = graph_encoder(thinker.apm)
        try:
            graph.capture()
        except Exception as exc:  # no CUDA stream on this machine
            result["capture_refused"] = f"{type(exc).__name__}: {exc}"
        result["after_failed_capture"] = figures(observe.observe(pause=lambda: None))
        batch, total = graph.max_batch, graph.max_cache_bucket + graph.unit_length
        zeros = functools.partial(torch.zeros, dtype=graph.dtype, device=graph.device)
        graph._mel = zeros((batch, int(graph.encoder.config.num_mel_bins), graph.unit_frames))
        graph._cache = zeros((len(graph.encoder.layers), 2, batch, total, graph.embed_dim))
        graph._mask = zeros((batch, 1, graph.unit_length, total))
        (known,) = [k for k in KNOWN_CLASSES if k.name == type(graph).__name__]
        assert Holders.active is not None
        Holders.active.stored(graph, known)
        thinker._duplex_audio_cuda_graph_encoder = graph  # where build_streaming_audio_graph_encoder keeps it
        result["graph_cache"] = storage_bytes([graph._cache])
        return result

    AFTER_PUBLISH["minicpmo"] = grow
    return root, held


def graph_encoder(encoder: Any) -> Any:
    """MiniCPM-o's StreamingAudioGraphEncoder on `encoder` with the fields its real __init__ sets (which refuses a
    CPU encoder first), for one batch of up to 2 sessions and one 250-position cache bucket."""
    from vllm_omni.model_executor.models.minicpmo_4_5 import streaming_audio_encoder_graph as graphs

    graph = graphs.StreamingAudioGraphEncoder.__new__(graphs.StreamingAudioGraphEncoder)
    weight, config = encoder.conv1.weight, encoder.config
    graph.encoder, graph.device, graph.dtype = encoder, weight.device, weight.dtype
    graph.embed_dim, graph.num_heads = int(config.d_model), int(config.encoder_attention_heads)
    graph.unit_frames = 40
    graph.unit_length = graphs.steady_unit_length(graph.unit_frames)
    graph.batch_sizes, graph.cache_buckets = (1, 2), (250,)
    graph.max_batch, graph.max_cache_bucket = 2, 250
    graph._graphs = {}
    return graph


def figures(observation: Any) -> dict[str, list[int]]:
    return {o.owner: [o.bytes, o.caches, o.peak_bytes] for o in observation.owners}


def nemotron() -> tuple[Any, dict[str, Any]]:
    """NemotronVoiceChat's native-talker CFG stream: the real UncondStream on a tiny HF Gemma3 backbone."""
    import torch
    from transformers import Gemma3TextConfig, Gemma3TextModel
    from vllm_omni.model_executor.models.nemotron_voicechat.nemo_vendored.duplex_ear_tts import DuplexEARTTS
    from vllm_omni.model_executor.models.nemotron_voicechat.nemo_vendored.ear_tts_model import RVQEARTTSModel
    from vllm_omni.model_executor.models.nemotron_voicechat.nemotron_voicechat_talker import (
        NemotronVoiceChatTalkerForConditionalGeneration,
    )
    from vllm_omni.model_executor.models.nemotron_voicechat.talker_native import UncondStream

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        sliding_window=8,
    )
    tts_model = bare(RVQEARTTSModel, backbone=Gemma3TextModel(config).eval(), hidden_size=config.hidden_size)
    talker = bare(NemotronVoiceChatTalkerForConditionalGeneration, tts=bare(DuplexEARTTS, tts_model=tts_model))
    stream = UncondStream(tts_model)
    stream.prefill(torch.randn(1, 6, config.hidden_size))
    for _ in range(3):
        stream.step(torch.randn(1, 1, config.hidden_size))
    talker.uncond_stream = stream  # a session's state holds it (session["uncond_stream"])
    tensors = [t for layer in stream.cache.layers for t in (layer.keys, layer.values)]
    held = {"cache_class": type(stream.cache).__name__, "cache": storage_bytes(tensors), "positions": stream.pos}
    return talker, held


# What a model does between its published sample and a second one (its figures join held.json; the second
# observation's owners are written as "later": owner -> [bytes, caches, peak_bytes]).
AFTER_PUBLISH: dict[str, Callable[[], dict[str, Any]]] = {}

MODELS: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {
    "vibevoice": vibevoice,
    "minicpmo": minicpmo,
    "nemotron": nemotron,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    settings = HookSettings(
        disabled=False, directory=args.out, explicit_directory=True, collector="auto", observe_interval_s=1.0
    )
    assert "transformers" not in sys.modules  # the cache class is patched as transformers defines it
    install_post_import(observe.patches(settings))
    model, held = MODELS[args.model]()
    import torch

    runner = SimpleNamespace(
        model=model,
        device=torch.device("cpu"),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
        model_config=SimpleNamespace(served_model_name=[args.model], model=args.model),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    path = publish(runner, Phase.LOAD, settings)
    after = AFTER_PUBLISH.get(args.model)
    if after is not None:
        held.update(after())
        held["later"] = figures(observe.observe(pause=lambda: None))
    observe.stop()
    assert path is not None
    # The hook removes its manifests when the process exits: keep a copy for the test.
    copy = args.out / "published" / path.name
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    (args.out / "held.json").write_text(json.dumps({"manifest": str(copy), **held}))


if __name__ == "__main__":
    main()
