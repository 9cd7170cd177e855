"""The served architecture: vLLM's Qwen2 with an inner module that owns real transformers caches.

The inner module declares its caches with vllm-omni's own protocol, imported the stock way, so that
vllm-omni's OmniGPUModelRunner logs their total after load and kv-exporter's hook can publish them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig, StaticCache
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm_omni.model_executor.models.model_local_kv import (
    ModelLocalKVScope,
    ModelLocalKVSpec,
    RowDriver,
    spec_from_hf_config,
)

from kv_exporter.cachebytes import measure_cache_bytes
from kvx_omni_testplugin.tiny_model import STATIC_CAPACITY, WINDOW_POSITIONS

# Where the model writes what its caches really hold, one JSON file per process (set by the tests).
REPORT_DIR_ENV = "KVX_OMNI_REPORT_DIR"


class LocalKVOwner(nn.Module):
    """Owns one StaticCache (one serialized loop) and one DynamicCache per engine sequence slot.

    The caches are materialised when the weights are loaded (``materialize``): StaticCache allocates each
    layer at its first update, and each DynamicCache holds WINDOW_POSITIONS positions per layer.
    """

    def __init__(self, config: PretrainedConfig, max_num_seqs: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.max_num_seqs = max_num_seqs
        self.cache_dtype = dtype
        self.static_cache = StaticCache(config=config, max_cache_len=STATIC_CAPACITY)
        self.window_caches = [DynamicCache() for _ in range(max_num_seqs)]

    def _kv(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.config.num_key_value_heads, positions, self.config.head_dim)
        return torch.zeros(shape, dtype=self.cache_dtype), torch.zeros(shape, dtype=self.cache_dtype)

    def materialize(self) -> None:
        for layer in range(self.config.num_hidden_layers):
            self.static_cache.update(*self._kv(1), layer)
            for cache in self.window_caches:
                cache.update(*self._kv(WINDOW_POSITIONS), layer)
        self._report()

    def _report(self) -> None:
        """Write the bytes the cache tensors hold, so a test can hold the declarations against them."""
        folder = os.environ.get(REPORT_DIR_ENV)
        if not folder:
            return
        report = {
            "pid": os.getpid(),
            "loop_static_cache": measure_cache_bytes(self.static_cache).shown_bytes,
            "window_cache": sum(measure_cache_bytes(c).shown_bytes for c in self.window_caches),
        }
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"caches-{os.getpid()}.json").write_text(json.dumps(report))

    def model_local_kv_specs(self) -> Sequence[ModelLocalKVSpec]:
        return [
            spec_from_hf_config(
                self.config,
                name="loop_static_cache",
                physical_capacity_positions=STATIC_CAPACITY,
                capacity_source=f"StaticCache max_cache_len={STATIC_CAPACITY} (test constant)",
                scope=ModelLocalKVScope.MODEL,
                dtype=self.cache_dtype,
                rows=RowDriver.FIXED,
                rows_fixed=1,
                rows_reason="one serialized loop holds the only StaticCache, batch 1",
            ),
            spec_from_hf_config(
                self.config,
                name="window_cache",
                physical_capacity_positions=WINDOW_POSITIONS,
                capacity_source=f"window of {WINDOW_POSITIONS} positions (test constant)",
                scope=ModelLocalKVScope.REQUEST,
                dtype=self.cache_dtype,
                rows=RowDriver.MAX_NUM_SEQS,
                allocation_note="one DynamicCache per sequence slot, built at load",
            ),
        ]


class KvxTinyQwen2ForCausalLM(Qwen2ForCausalLM):
    """vLLM's Qwen2 for the text path; ``local_kv`` holds the model-local caches."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        hf_config = vllm_config.model_config.hf_config
        max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        self.local_kv = LocalKVOwner(hf_config, max_num_seqs, vllm_config.model_config.dtype)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        # vllm-omni's AR runner passes extra keywords (sampling_metadata, runtime_additional_information,
        # ...) that a plain vLLM text model does not take.
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        self.local_kv.materialize()
        return loaded
