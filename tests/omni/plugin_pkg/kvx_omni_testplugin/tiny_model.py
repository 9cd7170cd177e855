"""Build a tiny Qwen2 checkpoint and a byte-level BPE tokenizer on disk (nothing comes from a model hub).

Run with the omni environment's interpreter so that the checkpoint is written by the transformers
version that serves it:  .venv-omni/bin/python -m kvx_omni_testplugin.tiny_model DIR
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# The architecture name routes the checkpoint to our pipeline (hf_architectures) and to our model class
# in both model registries; model_type stays "qwen2" so transformers loads a stock Qwen2Config.
ARCHITECTURE = "KvxTinyQwen2ForCausalLM"
PIPELINE_MODEL_TYPE = "kvx_tiny_qwen2"

HIDDEN = 128
HEADS = 4
KV_HEADS = 2
LAYERS = 2
VOCAB = 1024
# The CPU attention backend rejects head size 16; 128 / 4 = 32 is accepted.
HEAD_DIM = HIDDEN // HEADS
MAX_POSITIONS = 512
EOS = "<|endoftext|>"
# The float32 checkpoint is served in float32 (--dtype float32): 4 bytes per element.
ITEMSIZE = 4

# Positions of the model-local caches the inner module owns (model.py), here so that the tests can derive
# the expected declarations without importing torch:
# a talker-like loop that runs one request at a time up to a hard-coded length (ming's StaticCache shape),
STATIC_CAPACITY = 64
# and a per-sequence window cache (Qwen3-TTS codec decoder shape: sliding window - 1 positions).
WINDOW_POSITIONS = 15

_TEXT = (
    "cache key value layer head token stage replica engine worker model page metric gauge request sequence "
    "window prefix decode prefill memory block scheduler runner sample batch stream audio text"
)
_WORDS = _TEXT.split()


def _corpus(lines: int, seed: int = 0) -> list[str]:
    """Deterministic pseudo-text: enough variety for a 1024-entry byte-level BPE vocabulary."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) + "." for _ in range(lines)]


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(4000), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=None)
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(out)


def build_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        eos_token_id=0,
        bos_token_id=0,
    )
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
    # save_pretrained writes the class name; the served architecture is ours. float32 runs on every
    # x86 CPU kernel here.
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data["architectures"] = [ARCHITECTURE]
    data["dtype"] = "float32"
    cfg_path.write_text(json.dumps(data, indent=2))


def build(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(out))
    build_model(out, max(vocab_size, VOCAB))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    print(build(parser.parse_args().out))


if __name__ == "__main__":
    main()
