"""Upstream model roots built by their real `__init__`, which builds vLLM's own layers: a real VllmConfig for a tiny
config written to a folder, current for the rest of the process, and a one-process distributed group (gloo), as a
vLLM worker has them when it builds the model. One model per process: vLLM's distributed group is process-wide.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_CURRENT: list[Any] = []


def vllm_config_for(folder: Path, hf_config: Any) -> Any:
    """A real VllmConfig for `hf_config` (written to `folder`), current, with a one-process distributed group: what
    a model's real `__init__` needs to build vLLM's parallel layers on this CPU."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    hf_config.save_pretrained(folder)
    model_config = ModelConfig(
        model=str(folder), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, enforce_eager=True
    )
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu"), load_config=LoadConfig(load_format="dummy")
    )
    context = set_current_vllm_config(vllm_config)
    context.__enter__()  # for the child's life: the model's layers read it when they run too
    _CURRENT.append(context)  # a context manager nobody refers to is closed, and the config with it
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"file://{folder / 'dist-init'}",
        backend="gloo",
    )
    initialize_model_parallel(1, 1)
    return vllm_config


def mimo_root(folder: Path) -> Any:
    """MiMo-Audio's root through its real `__init__` (vLLM's Qwen2 inside, its buffers registered), in bf16 as
    vLLM's loader builds it. The tiny config keeps the checkpoint's relations: main LLM layers > local transformer
    layers > input local layers (the local configs copy the main one's layer types), local heads > 2 (a hidden
    state's last dimension is never one or two head sizes), mrope's 128-wide heads for the main LLM."""
    import torch
    from vllm_omni.model_executor.models.mimo_audio.config_mimo_audio import MiMoAudioConfig
    from vllm_omni.model_executor.models.mimo_audio.mimo_audio_llm import MiMoAudioLLMForConditionalGeneration

    config = MiMoAudioConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        group_size=4,
        audio_channels=2,
        delay_pattern="0-1",
        speech_vocab_size="17-17",
        speech_zeroemb_idx="16-16",
        local_dim=64,
        local_layers=3,
        local_attn_heads=4,
        local_ffn_dim=128,
        input_local_layers=2,
        input_full_attention=True,
        architectures=["Qwen2ForCausalLM"],  # the checkpoint's: its model_type stays qwen2
    )
    vllm_config = vllm_config_for(folder, config)
    torch.set_default_dtype(torch.bfloat16)  # what vLLM's loader does around a model's __init__
    try:
        return MiMoAudioLLMForConditionalGeneration(vllm_config=vllm_config)
    finally:
        torch.set_default_dtype(torch.float32)
