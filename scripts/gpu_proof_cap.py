"""Part 4 of the GPU proof (scripts/gpu_proof.py): the allocator's per-process cap, which only a GPU can show.

vLLM 0.34 caps each worker's torch allocator (`set_per_process_memory_fraction`); a model-local cache that grows past
the cap fails with torch's out-of-memory error while NVML still shows the device free. Here the cap is set as vLLM sets
it (what torch reserves now plus ROOM), a declaring module grows real transformers caches one sequence (one declared
row) at a time, the sidecar (real NVML) exports the worker's cap and headroom from this process's manifest, and the
row at which torch fails must be the one the exported figures predict, within one row, while NVML shows GiBs free.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

GIB = 1 << 30
ROOM = 2 * GIB  # what the cap leaves past what torch reserves when it is set
# One sequence's cache: 4 layers x 8 KV heads x 2048 positions x 128 dims, bf16, K and V: 32 MiB a row.
LAYERS, KV_HEADS, POSITIONS, HEAD_DIM = 4, 8, 2048, 128
MAX_NUM_SEQS = 128  # 4 GiB at max_num_seqs: past the cap's room
HELD_AT_SAMPLE = 4  # sequences running when the sidecar is scraped


def allocator_cap(torch: Any, scrape: Any) -> list[str]:
    """The failures, if any. `scrape(folder)` runs the sidecar on the manifest folder and returns its page."""
    from transformers import DynamicCache

    from kv_exporter.manifest import Declaration, EngineIdentity, Manifest, Phase, ProcessInfo, write_manifest
    from kv_exporter.plugin import baseline, identity, observe
    from kv_exporter.protocol import ModelLocalKVScope, ModelLocalKVSpec, RowDriver

    device = torch.device("cuda", torch.cuda.current_device())
    spec = ModelLocalKVSpec(
        name="request",
        layers=LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        physical_capacity_positions=POSITIONS,
        capacity_source="gpu-proof",
        scope=ModelLocalKVScope.REQUEST,
        rows=RowDriver.MAX_NUM_SEQS,
    )
    declaration = Declaration.from_spec("codec", spec)

    class Codec(torch.nn.Module):  # type: ignore[misc]  # torch is passed in: Any to mypy
        def forward(self) -> Any:  # one sequence's cache, made inside the declaring module (its owner)
            cache = DynamicCache()
            for layer in range(LAYERS):
                k = torch.zeros(1, KV_HEADS, POSITIONS, HEAD_DIM, dtype=torch.bfloat16, device=device)
                cache.update(k, torch.zeros_like(k), layer)
            return cache

    model = torch.nn.Module()
    model.codec = Codec()
    observe.attach(model, [declaration], device)
    torch.cuda.synchronize()
    total = torch.cuda.mem_get_info(device)[1]
    cap = torch.cuda.memory_reserved(device) + ROOM
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    held: list[Any] = []
    try:
        held += [model.codec() for _ in range(HELD_AT_SAMPLE)]
        torch.cuda.synchronize()
        runner = _Runner(device)
        dev, base = baseline.measure(runner, identity.device_info(runner))
        manifest = Manifest(
            engine=EngineIdentity(model_name="gpu-proof-cap"),
            process=ProcessInfo.current(),
            device=dev,
            max_num_seqs=MAX_NUM_SEQS,
            phase=Phase.WARMUP,
            collector="kv_exporter",
            declarations=(declaration,),
            baseline=base,
            observation=observe.observe(pause=lambda: None),
        )
        folder = Path(tempfile.mkdtemp(prefix="kvx-gpu-proof-cap-"))
        write_manifest(folder, manifest)
        series = _series(scrape(folder))
        failed_at, nvml_free = _grow_until_refused(torch, model, held)
    finally:
        held.clear()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    return _judge(series, cap, manifest, failed_at, nvml_free)


class _Runner:
    def __init__(self, device: Any) -> None:
        self.device = device


def _grow_until_refused(torch: Any, model: Any, held: list[Any]) -> tuple[int | None, int | None]:
    """The sequences held when torch refused one more (None: never refused), and NVML's free bytes then."""
    for _ in range(MAX_NUM_SEQS * 4):
        try:
            held.append(model.codec())
        except torch.OutOfMemoryError:
            return len(held), _nvml_free(torch)
    return None, None


def _nvml_free(torch: Any) -> int | None:
    from kv_exporter.plugin.identity import torch_uuid

    with contextlib.suppress(Exception):  # no nvidia-ml-py, or NVML cannot answer: said as None
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(torch_uuid(torch.cuda.current_device()))
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
    return None


def _series(text: str) -> dict[str, float]:
    return {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] not in "#"}


def _one(series: dict[str, float], family: str) -> float | None:
    found = [value for name, value in series.items() if name.startswith(family + "{")]
    return found[0] if len(found) == 1 else None


def _judge(
    series: dict[str, float], cap: int, manifest: Any, failed_at: int | None, nvml_free: int | None
) -> list[str]:
    row = manifest.declarations[0].bytes_per_row
    limit = _one(series, "model_local_kv_worker_allocator_limit_bytes")
    headroom = _one(series, "model_local_kv_worker_headroom_bytes")
    safe = _one(series, "model_local_kv_gpu_safe_max_num_seqs")
    binding = [name for name, value in series.items() if name.startswith("model_local_kv_gpu_limit_binding{") and value]
    print(f"allocator cap set: {cap} B; exported cap {limit}, worker headroom at max_num_seqs {headroom} B")
    print(f"exported safe max_num_seqs {safe}; torch refused one more sequence at {failed_at} held ({row} B a row)")
    print(f"NVML free then: {nvml_free} B; binding limit: {binding}")
    failures = []
    if limit is None or abs(limit - cap) > 1:
        failures.append(f"cap: the exported worker cap {limit} is not the cap set, {cap}")
    if headroom is None or headroom >= 0:
        failures.append("cap: the worker headroom does not say max_num_seqs fails under the cap")
    if failed_at is None:
        failures.append("cap: torch never refused a sequence under the cap")
    elif safe is None or abs(failed_at - safe) > 1:
        failures.append(f"cap: torch refused one more sequence at {failed_at} held; the figures said {safe} fit")
    if nvml_free is not None and nvml_free < row:
        failures.append("cap: NVML had no free memory left: the device, not the cap, refused")
    if not any('limit="worker"' in name for name in binding):
        failures.append("cap: the GPU's binding limit is not the worker's")
    return failures
