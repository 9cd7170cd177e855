"""The observed architecture: vLLM's Qwen2 plus four inner modules whose real transformers caches come and go with
the requests, so that what kv-exporter observes can be held against what the model really holds, to the byte.

`kvx_observed` (`ObservedOwners`) has four owners (paths in geometry.py):

- `truthful` declares max_num_seqs rows of its per-request cache and holds one per running request;
- `under` declares one FIXED row and holds one per running request (the design notes' failure);
- `undeclared` declares nothing and holds one per running request;
- `never` declares max_num_seqs rows and never allocates (the "invented gigabyte");
- `in_step` declares nothing and holds caches only inside each step (per-request caches filled by a real forward of
  a tiny transformers Qwen2, their concatenation, a deep copy), so only the high-water mark between samples can
  show them.

`KvxRequestsCPUModelRunner` (worker.py) tells `kvx_observed`, before each step, which requests the step schedules
and which have finished. The step's forward gives each holder one `DynamicCache` per newly running request, made in
the holder's own forward and filled once with its REQUEST_POSITIONS positions (so a cache's bytes never change while
it lives); `schedule` drops the finished requests' caches (nothing else refers to them: they are freed at once).

The record: with KVX_TEST_REPORT_DIR set, every change of what the holders hold is appended to
`<dir>/held-<pid>.jsonl` as `{"begin": t0, "end": t1, "owners": {path: {"bytes": B, "caches": N}}}`, t0 taken before
the first cache object of the change is made or dropped and t1 after the last, both `time.time()` (the clock of the
sampler's `taken_at`), B from `measure_cache_bytes` of every cache the owner holds after the change. The first line
(at construction) holds nothing. Each step of `in_step` that makes caches is appended to `<dir>/steps-<pid>.jsonl`
as `{"begin": t0, "end": t1, "peak": B}`: B the most its caches held after any of the step's operations, summed
from `measure_cache_bytes` (no storage is shared between them: the concatenation and the copy are new storage).
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

from kv_exporter.cachebytes import measure_cache_bytes
from kv_exporter.protocol import ModelLocalKVScope, RowDriver, spec_from_hf_config
from kvx_testplugin.geometry import (
    NEVER_POSITIONS,
    REQUEST_POSITIONS,
    SIDE_HEAD_DIM,
    SIDE_KV_HEADS,
    SIDE_LAYERS,
    STEP_POSITIONS,
    TRUTHFUL_OWNER,
    UNDECLARED_OWNER,
    UNDER_OWNER,
)
from kvx_testplugin.model import ENV_REPORT_DIR, side_config

CACHE_NAME = "request_cache"


def filled_cache(positions: int) -> Any:
    """A DynamicCache holding `positions` positions in every layer, K and V in storages of their own."""
    from transformers import DynamicCache

    cache = DynamicCache()
    shape = (1, SIDE_KV_HEADS, positions, SIDE_HEAD_DIM)
    for layer in range(SIDE_LAYERS):
        cache.update(torch.zeros(shape), torch.zeros(shape), layer)
    return cache


def request_spec(positions: int, rows: RowDriver, **spec: Any) -> Any:
    return spec_from_hf_config(
        side_config(torch.float32),
        name=CACHE_NAME,
        physical_capacity_positions=positions,
        capacity_source="positions written at admission (test constant)",
        scope=ModelLocalKVScope.REQUEST,
        dtype=torch.float32,
        rows=rows,
        **spec,
    )


class RequestHolder(nn.Module):
    """One DynamicCache per running request, made in this module's forward. Its three subclasses share this code,
    so the tracker tells them apart by the frame's `self`."""

    def __init__(self, positions: int) -> None:
        super().__init__()
        self.positions = positions
        self.caches: dict[str, Any] = {}

    def forward(self, admitted: Sequence[str]) -> None:
        for request in admitted:
            self.caches[request] = filled_cache(self.positions)

    def release(self, finished: Iterable[str]) -> None:
        for request in finished:
            self.caches.pop(request, None)

    def held(self) -> dict[str, int]:
        total = sum(measure_cache_bytes(cache).allocated_bytes for cache in self.caches.values())
        return {"bytes": total, "caches": len(self.caches)}


class TruthfulHolder(RequestHolder):
    def model_local_kv_specs(self) -> list[Any]:
        return [request_spec(self.positions, RowDriver.MAX_NUM_SEQS)]


class UnderDeclaringHolder(RequestHolder):
    def model_local_kv_specs(self) -> list[Any]:
        reason = "wrongly: one row, however many requests run"
        return [request_spec(self.positions, RowDriver.FIXED, rows_fixed=1, rows_reason=reason)]


class UndeclaredHolder(RequestHolder):
    """Declares nothing."""


class NeverAllocating(nn.Module):
    def model_local_kv_specs(self) -> list[Any]:
        note = "declared unconditionally; this path never allocates"
        return [request_spec(NEVER_POSITIONS, RowDriver.MAX_NUM_SEQS, allocation_note=note)]


def concatenated(caches: Sequence[Any]) -> Any:
    """One batched cache from per-request ones (new storage: torch.cat), as a batching decoder builds it."""
    from transformers import DynamicCache

    batched = DynamicCache()
    for layer in range(SIDE_LAYERS):
        keys = torch.cat([cache.layers[layer].keys for cache in caches])
        values = torch.cat([cache.layers[layer].values for cache in caches])
        batched.update(keys, values, layer)
    return batched


class InStep(nn.Module):
    """Declares nothing; every cache it makes is freed when its forward returns. Each per-request cache is filled by
    a real forward of a 2-layer transformers Qwen2 (the side geometry), as Qwen3-TTS's decoder fills its own:
    the work a cache update sits in, not a bare copy, so the decode benchmark weighs the tracking against it."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen2Model

        torch.manual_seed(0)
        lm = Qwen2Model(side_config(torch.float32)).to(torch.float32).eval()
        self.__dict__["_lm"] = lm  # outside the module tree: vLLM's loader wants every parameter in the checkpoint
        self._prompt = torch.arange(STEP_POSITIONS).unsqueeze(0) % lm.config.vocab_size
        folder = os.environ.get(ENV_REPORT_DIR)
        self._path = Path(folder, f"steps-{os.getpid()}.jsonl") if folder else None

    def request_cache(self) -> Any:
        from transformers import DynamicCache

        cache = DynamicCache()
        with torch.no_grad():
            self._lm(input_ids=self._prompt, past_key_values=cache, use_cache=True)
        return cache

    def forward(self, running: int) -> None:
        if not running:
            return
        begin, peak = time.time(), 0
        caches: list[Any] = []
        recording = self._path is not None  # the model's own count only for the test's record, not in benchmarks

        def made(cache: Any) -> None:
            nonlocal peak
            caches.append(cache)
            if recording:
                peak = max(peak, sum(measure_cache_bytes(held).allocated_bytes for held in caches))

        for _ in range(running):
            made(self.request_cache())
        made(concatenated(caches))
        made(copy.deepcopy(caches[-1]))
        caches.clear()
        if self._path is not None:
            with self._path.open("a", encoding="utf-8") as record:
                record.write(json.dumps({"begin": begin, "end": time.time(), "peak": peak}) + "\n")


class HeldRecord:
    """Appends each change of what the holders hold to `<report dir>/held-<pid>.jsonl` (nothing without the dir)."""

    def __init__(self, holders: dict[str, RequestHolder]) -> None:
        self._holders = holders
        folder = os.environ.get(ENV_REPORT_DIR)
        self._path = Path(folder, f"held-{os.getpid()}.jsonl") if folder else None
        now = time.time()
        self._write(now, now)

    @contextmanager
    def change(self) -> Iterator[None]:
        begin = time.time()
        try:
            yield
        finally:
            self._write(begin, time.time())

    def _write(self, begin: float, end: float) -> None:
        if self._path is None:
            return
        owners = {path: holder.held() for path, holder in self._holders.items()}
        with self._path.open("a", encoding="utf-8") as record:
            record.write(json.dumps({"begin": begin, "end": end, "owners": owners}) + "\n")


class ObservedOwners(nn.Module):
    """`kvx_observed` (OBSERVED_PARENT): its attribute names are the owners' last path components."""

    def __init__(self) -> None:
        super().__init__()
        self.truthful = TruthfulHolder(REQUEST_POSITIONS[TRUTHFUL_OWNER])
        self.under = UnderDeclaringHolder(REQUEST_POSITIONS[UNDER_OWNER])
        self.undeclared = UndeclaredHolder(REQUEST_POSITIONS[UNDECLARED_OWNER])
        self.never = NeverAllocating()
        self.in_step = InStep()
        holders = {TRUTHFUL_OWNER: self.truthful, UNDER_OWNER: self.under, UNDECLARED_OWNER: self.undeclared}
        self._holders = tuple(holders.values())
        self._record = HeldRecord(holders)
        self._admit: tuple[str, ...] = ()

    def schedule(self, running: Iterable[str], finished: Collection[str]) -> None:
        """Before a step: drop the finished requests' caches; the step's forward makes the new requests' ones."""
        gone = [request for request in finished if request in self.truthful.caches]
        if gone:
            with self._record.change():
                for holder in self._holders:
                    holder.release(gone)
        self._admit = tuple(request for request in running if request not in self.truthful.caches)

    def forward(self) -> None:
        admit, self._admit = self._admit, ()
        if admit:
            with self._record.change():
                for holder in self._holders:
                    holder(admit)
        self.in_step(len(self.truthful.caches))


class KvxObservedForCausalLM(Qwen2ForCausalLM):
    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.kvx_observed = ObservedOwners()

    def forward(self, input_ids: Any, positions: Any, *args: Any, **kwargs: Any) -> Any:
        self.kvx_observed()
        return super().forward(input_ids, positions, *args, **kwargs)
