"""An out-of-tree vLLM architecture whose inner submodules own REAL transformers caches and declare them.

`KvxTestForCausalLM` is vLLM's Qwen2 (it serves real completions) plus `kvx_talker`, a parameter-free module
tree (no checkpoint weights needed) that mimics the vllm-omni models of the design notes:

- `kvx_talker.decoder` holds a `DynamicCache` filled by a real prefill of a tiny transformers Qwen2 and
  declares it through kv_exporter's protocol (one row per sequence, like the Qwen3-TTS codec decoder);
- `kvx_talker.encoder` holds a `StaticCache` (bf16) filled the same way and declares it through vllm-omni
  0.30's own `model_local_kv.py`, loaded by file path from the installed wheel (one row per session);
- `kvx_talker` itself declares a "graph pool" from live state: one row per distinct batch size its forward
  has seen, so it declares nothing right after load and something after the profile / warm-up runs.

Test instrumentation: with KVX_TEST_REPORT_DIR set, every declaration call writes what it measured (the real
cache bytes, the live state it declared from, which runner methods are hooked) to `<dir>/<pid>.json`.
KVX_TEST_RAISE=<owner attribute> makes that owner's declaration raise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

from kv_exporter.cachebytes import measure_cache_bytes
from kv_exporter.protocol import ModelLocalKVScope, RowDriver, spec_from_hf_config
from kvx_testplugin.geometry import (
    DECODER_POSITIONS,
    ENCODER_CAPACITY,
    ENCODER_PREFILL,
    LATE_POSITIONS,
    SIDE_HEADS,
    SIDE_HIDDEN,
    SIDE_KV_HEADS,
    SIDE_LAYERS,
)

ENV_REPORT_DIR = "KVX_TEST_REPORT_DIR"
ENV_RAISE = "KVX_TEST_RAISE"
ENV_MANIFEST_DIR = "KV_EXPORTER_DIR"
RUNNER_CLASSES = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
)

_report: dict[str, Any] = {"pid": os.getpid(), "calls": []}


def _write_report() -> None:
    folder = os.environ.get(ENV_REPORT_DIR)
    if folder:
        path = Path(folder, f"{os.getpid()}.json")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(_report, indent=1, sort_keys=True))
        tmp.replace(path)


def record(owner: str, **facts: Any) -> None:
    _report["calls"].append({"owner": owner, **facts})
    _write_report()


def spec_fields(spec: Any) -> dict[str, Any]:
    """A spec's fields as JSON, with dtypes and enums spelled as the manifest spells them."""
    return {
        "name": spec.name,
        "layers": spec.layers,
        "kv_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "physical_capacity_positions": spec.physical_capacity_positions,
        "capacity_source": spec.capacity_source,
        "scope": spec.scope.value,
        "rows": spec.rows.value,
        "rows_fixed": spec.rows_fixed,
        "rows_reason": spec.rows_reason,
        "allocation_note": spec.allocation_note,
        "bytes_per_row": spec.bytes_per_row,
    }


def declare(owner: str, specs: list[Any], **facts: Any) -> list[Any]:
    record(owner, declared=[spec_fields(spec) for spec in specs], **facts)
    return specs


def _maybe_raise(owner: str) -> None:
    if os.environ.get(ENV_RAISE) == owner:
        raise RuntimeError(f"kvx test: {owner}.model_local_kv_specs() raises on purpose")


def upstream_protocol() -> Any:
    """vllm-omni 0.30's protocol module, loaded by file path (its package __init__ fails on vLLM 0.32)."""
    name = "kvx_testplugin._upstream_model_local_kv"
    if name in sys.modules:
        return sys.modules[name]
    package = importlib.util.find_spec("vllm_omni")
    assert package is not None and package.submodule_search_locations
    path = Path(package.submodule_search_locations[0], "model_executor", "models", "model_local_kv.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses need it while being defined
    spec.loader.exec_module(module)
    return module


def side_config(dtype: torch.dtype) -> Any:
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=SIDE_HIDDEN,
        intermediate_size=128,
        num_hidden_layers=SIDE_LAYERS,
        num_attention_heads=SIDE_HEADS,
        num_key_value_heads=SIDE_KV_HEADS,
        max_position_embeddings=128,
    )
    config.dtype = dtype
    return config


def prefill(config: Any, cache: Any, positions: int) -> Any:
    """A real transformers forward that fills `cache`; the model is dropped, the cache kept."""
    from transformers import Qwen2Model

    torch.manual_seed(0)
    model = Qwen2Model(config).to(config.dtype).eval()
    with torch.no_grad():
        model(input_ids=torch.arange(positions).unsqueeze(0) % config.vocab_size, past_key_values=cache, use_cache=True)
    return cache


class CodecDecoder(nn.Module):
    """Declares through kv_exporter's protocol."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import DynamicCache

        self.config = side_config(torch.float32)
        self.cache = prefill(self.config, DynamicCache(config=self.config), DECODER_POSITIONS)

    def model_local_kv_specs(self) -> list[Any]:
        _maybe_raise("decoder")
        specs = [
            spec_from_hf_config(
                self.config,
                name="codec_cache",
                physical_capacity_positions=DECODER_POSITIONS,
                capacity_source="prefill length of the test decoder",
                scope=ModelLocalKVScope.REQUEST,
                dtype=torch.float32,
                rows=RowDriver.MAX_NUM_SEQS,
            )
        ]
        return declare("decoder", specs, shown_bytes=measure_cache_bytes(self.cache).shown_bytes, batch=1)


class StreamingEncoder(nn.Module):
    """Declares through vllm-omni 0.30's own module."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import StaticCache

        self.config = side_config(torch.bfloat16)
        cache = StaticCache(config=self.config, max_cache_len=ENCODER_CAPACITY)
        self.cache = prefill(self.config, cache, ENCODER_PREFILL)  # StaticCache allocates at the first update

    def model_local_kv_specs(self) -> list[Any]:
        _maybe_raise("encoder")
        upstream = upstream_protocol()
        specs = [
            upstream.spec_from_hf_config(
                self.config,
                name="session_cache",
                physical_capacity_positions=ENCODER_CAPACITY,
                capacity_source="StaticCache max_cache_len",
                scope=upstream.ModelLocalKVScope.SESSION,
                dtype=torch.bfloat16,
                rows=upstream.RowDriver.FIXED,
                rows_fixed=1,
                rows_reason="one streaming session per process",
                allocation_note="one StaticCache object, allocated at the first update",
            )
        ]
        return declare("encoder", specs, shown_bytes=measure_cache_bytes(self.cache).shown_bytes, batch=1)


class Talker(nn.Module):
    """Owns the two caches above and declares a graph pool sized from live state (batch sizes seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = CodecDecoder()
        self.encoder = StreamingEncoder()
        self.seen_batch_sizes: set[int] = set()
        self.step_methods_recorded = False

    def observe(self, num_tokens: int) -> None:
        self.seen_batch_sizes.add(num_tokens)
        if not self.step_methods_recorded:
            self.step_methods_recorded = True
            record("runner_methods", wrapped=hooked_runner_methods())

    def model_local_kv_specs(self) -> list[Any]:
        _maybe_raise("talker")
        seen = sorted(self.seen_batch_sizes)
        # What the hook has written so far: shows the load-phase file before the warm-up one replaces it.
        on_disk = manifests_on_disk()
        if not seen:
            return declare("talker", [], seen=seen, manifests_on_disk=on_disk)  # declaring nothing is valid
        specs = [
            spec_from_hf_config(
                self.decoder.config,
                name="graph_pool",
                physical_capacity_positions=DECODER_POSITIONS,
                capacity_source="prefill length of the test decoder",
                scope=ModelLocalKVScope.MODEL,
                dtype=torch.float32,
                rows=RowDriver.FIXED,
                rows_fixed=len(seen),
                rows_reason="one row per distinct batch size seen (captured buckets)",
            )
        ]
        return declare("talker", specs, seen=seen, manifests_on_disk=on_disk)


class LateOwner(nn.Module):
    """Attached by KvxCPUModelRunner after super().load_model() returned, as vllm-omni's runners set up more."""

    def model_local_kv_specs(self) -> list[Any]:
        specs = [
            spec_from_hf_config(
                side_config(torch.float32),
                name="late_cache",
                physical_capacity_positions=LATE_POSITIONS,
                capacity_source="attached after the inner load_model",
                scope=ModelLocalKVScope.MODEL,
                dtype=torch.float32,
                rows=RowDriver.FIXED,
                rows_fixed=1,
                rows_reason="one set-up object",
            )
        ]
        return declare("late", specs)


def manifests_on_disk() -> dict[str, Any]:
    folder = os.environ.get(ENV_MANIFEST_DIR)
    if not folder or not os.path.isdir(folder):
        return {}
    return {path.name: json.loads(path.read_text()) for path in sorted(Path(folder).glob("*.json"))}


def hooked_runner_methods() -> dict[str, list[str]]:
    """For each V1 runner class: which of its own attributes kv_exporter wrapped (only load_model, __init__)."""
    from kv_exporter.plugin.hooks import is_wrapped

    result: dict[str, list[str]] = {}
    for module_name, class_name in RUNNER_CLASSES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None:
            result[class_name] = sorted(name for name, value in vars(cls).items() if is_wrapped(value))
    return result


class KvxTestForCausalLM(Qwen2ForCausalLM):
    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.kvx_talker = Talker()

    def forward(self, input_ids: Any, positions: Any, *args: Any, **kwargs: Any) -> Any:
        self.kvx_talker.observe(int(positions.shape[-1]))
        return super().forward(input_ids, positions, *args, **kwargs)
