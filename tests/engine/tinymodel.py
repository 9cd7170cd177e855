"""Builds a tiny random Qwen2 checkpoint and a byte-level BPE tokenizer locally (nothing is downloaded).

The geometry is the smallest the vLLM CPU attention backend accepts: it rejects head size 16, so hidden 128
with 4 heads gives head size 32. The architecture name is the test plugin's out-of-tree class, which is a
Qwen2 whose inner submodules own real transformers caches (tests/engine/testplugin/kvx_testplugin/model.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.engine.testplugin.kvx_testplugin.geometry import ARCHITECTURE

VOCAB_SIZE = 1024
MAX_POSITIONS = 512

# Enough varied text for the BPE trainer to reach a vocabulary near VOCAB_SIZE.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the model keeps its own cache.",
    "Attention keys and values live in transformers cache objects outside the paged manager.",
    "A sliding window bounds the positions a cache can physically hold, not the sequence length.",
    "Prometheus scrapes the exporter, which reads manifests written by every worker process.",
    "Zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt.",
]


def build_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 2,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(directory)


def build_model(directory: Path, *, seed: int = 0, architecture: str = ARCHITECTURE) -> Path:
    """Writes config, safetensors weights and tokenizer into `directory` and returns it; vLLM serves it with the test
    plugin's `architecture` (geometry.ARCHITECTURE or geometry.OBSERVED_ARCHITECTURE)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    # vLLM picks the model class from `architectures`; the test plugin registers this name.
    config_path = directory / "config.json"
    data = json.loads(config_path.read_text())
    data["architectures"] = [architecture]
    config_path.write_text(json.dumps(data, indent=2))
    return directory


if __name__ == "__main__":
    import sys

    print(build_model(Path(sys.argv[1])))
