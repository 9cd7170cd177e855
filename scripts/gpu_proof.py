"""The GPU proof: what kv-exporter declares and observes, against what a CUDA device really allocates.

On a CUDA machine (`make gpu-proof`, i.e. `python3 -m scripts.gpu_proof` from the checkout, under that machine's
own python3 and packages):
1. For each reference geometry (kv_exporter.reference), real transformers caches are built on the GPU through
   their own update paths: Qwen3-TTS's sliding DynamicCache, MiMo-Audio's DynamicCache, MiniCPM-o's
   EncoderDecoderCache, ming_flash_omni's lazily allocated StaticCache. Each is measured five ways: the
   deltas of the allocator's requested and allocated bytes, the storage behind its tensors (measure_cache_bytes),
   the bytes kv-exporter's tracker observes (the plugin's own sampler code), and the bytes its declaration gives;
   then a raw bf16 pool in a declaring module's state (VibeVoice's form) against rule 1 of observe/holders.py.
2. The allocator's figures the observation carries (plugin/observe/cuda.py) against torch's own counters: the end of
   warm-up, 256 MiB no cache holds (unexplained growth, to the byte), a 1 GiB burst freed between two samples (the
   high-water, exact), a quiet interval (exact), an out-of-memory error (ooms, retries), and the peak never reset.
3. The sidecar runs on real NVML (`python -m kv_exporter serve`) over a manifest this process writes with its own
   device, as the hook writes it: the GPU label it exports must be NVML's index for the UUID torch reports, and
   the per-process figure NVML gives for this pid is printed beside torch's reserved memory; NVML's version 1 and 2
   memory figures side by side, and the reserved memory (v2) must be exported apart, used as DCGM exports it.
4. The allocator's per-process cap, as vLLM 0.34 sets it (scripts/gpu_proof_cap.py): caches grow toward it, and the
   worker headroom and safe max_num_seqs the sidecar exports predict the sequence torch refuses, within one, while
   NVML still shows the device free.
A table is printed; a failed check exits 1. Without a CUDA device it says so and exits 0. `--device cpu` runs
part 1 only, without the allocator column (the script's own test runs it so, where there is no GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.gpu_proof_cap import allocator_cap

REPO = Path(__file__).resolve().parent.parent
# torch's caching allocator serves a block of more than 1 MiB from a cached segment without splitting off a
# remainder of at most this much (kSmallSize): memory_allocated counts it, requested_bytes does not.
UNSPLIT_REMAINDER = 1 << 20
BATCH = 4  # rows of the max_num_seqs-driven caches


@dataclass
class Row:
    case: str
    declared: int
    storage: int
    observed: int
    allocated: int | None  # torch.cuda.memory_allocated delta; None off CUDA
    requested: int | None  # the allocator's requested_bytes delta (what was asked for, unrounded); None off CUDA
    tensors: int  # K and V tensors behind the cache: each a block of the allocator
    metadata: int  # the cache's other tensors (a layer's cumulative_length, a sliding window's size): not KV

    def checks(self) -> list[tuple[str, bool]]:
        found = [("tracker == storage", self.observed == self.storage)]
        if self.allocated is not None and self.requested is not None:
            # Nothing else may be held: what was asked for is the storage, to the byte; what the allocator counts
            # adds its rounding and the unsplit remainders of reused blocks.
            found.append(("requested == storage + metadata", self.requested == self.storage + self.metadata))
            slack = UNSPLIT_REMAINDER * self.tensors
            found.append(("allocated ~ storage", 0 <= self.allocated - self.storage <= slack))
        return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu-proof: no torch in this Python: nothing measured (it needs a CUDA build of torch and transformers)")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-proof: no CUDA device here (torch {torch.__version__}): nothing measured, nothing to prove")
        return 0
    tracker = install_tracker()

    def caches() -> list[str]:
        rows = list(measure_caches(torch, torch.device(args.device), tracker))
        print_table(rows)
        return [f"{row.case}: {name}" for row in rows for name, ok in row.checks() if not ok]

    parts = [
        caches,
        lambda: raw_pool(torch),
        lambda: allocator_figures(torch),
        lambda: sidecar_on_nvml(torch),
        lambda: allocator_cap(torch, scrape_sidecar),
    ]
    failed = [failure for part in parts[: 1 if args.device == "cpu" else None] for failure in isolated(part)]
    for failure in failed:
        print(f"FAILED {failure}")
    print("gpu-proof: all checks passed" if not failed else f"gpu-proof: {len(failed)} check(s) failed")
    return 1 if failed else 0


def isolated(part: Callable[[], list[str]]) -> list[str]:
    """A part's failures; one that raises is one failure (with its traceback printed), and the next part still runs:
    a GPU lent for minutes must give every answer it can."""
    try:
        return part()
    except Exception as exc:
        traceback.print_exc()
        return [f"a part raised {exc!r}"]


def install_tracker() -> Callable[[], int]:
    """The plugin's own cache tracker, installed as register() installs it; returns a function giving the bytes
    every live cache holds (the sampler's measurement). Must run before transformers is imported."""
    from kv_exporter.plugin import observe
    from kv_exporter.plugin.hooks import install_post_import
    from kv_exporter.plugin.settings import HookSettings

    settings = HookSettings(False, Path(tempfile.gettempdir()), True, "kv_exporter", observe_interval_s=1.0)
    install_post_import(observe.patches(settings))

    def observed() -> int:
        sample = observe.observe(pause=lambda: None)
        if sample.state.value != "ok":
            raise RuntimeError(f"the tracker is {sample.state.value}: {sample.reason}")
        return sum(owner.bytes for owner in sample.owners)

    return observed


def measure_caches(torch: Any, device: Any, observed: Callable[[], int]) -> Iterator[Row]:
    from transformers import DynamicCache, EncoderDecoderCache, MistralConfig, Qwen2Config, StaticCache

    from kv_exporter.cachebytes import measure_cache_bytes
    from kv_exporter.manifest import Declaration
    from kv_exporter.reference import MIMO_AUDIO, MING_FLASH_OMNI, MINICPM_O, QWEN3_TTS

    def declared(model: Any, rows: int) -> int:
        owner, spec = model.declarations[0]
        return Declaration.from_spec(owner, spec).bytes_per_row * rows

    def kv(spec: Any, batch: int, positions: int) -> tuple[Any, Any]:
        shape = (batch, spec.kv_heads, positions, spec.head_dim)
        dtype = getattr(torch, str(spec.dtype).removeprefix("torch."))
        return torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)

    def fill(cache: Any, spec: Any, batch: int, prefill: int, decode_steps: int, target: Any = None) -> Any:
        layers = target if target is not None else cache
        for positions in [prefill] + [1] * decode_steps:
            for layer in range(spec.layers):
                keys, values = kv(spec, batch, positions)
                layers.update(keys, values, layer, {"cache_position": torch.arange(positions, device=device)})
        return cache

    qwen = QWEN3_TTS.declarations[0][1]
    window = qwen.physical_capacity_positions + 1  # the declaration is sliding_window - 1
    sliding = MistralConfig(
        num_hidden_layers=qwen.layers, num_attention_heads=qwen.kv_heads, num_key_value_heads=qwen.kv_heads,
        head_dim=qwen.head_dim, hidden_size=qwen.kv_heads * qwen.head_dim, sliding_window=window,
    )  # fmt: skip
    mimo, minicpm, ming = (m.declarations[0][1] for m in (MIMO_AUDIO, MINICPM_O, MING_FLASH_OMNI))
    static = Qwen2Config(  # head_dim follows: hidden_size / num_attention_heads
        num_hidden_layers=ming.layers, num_attention_heads=ming.kv_heads, num_key_value_heads=ming.kv_heads,
        hidden_size=ming.kv_heads * ming.head_dim, use_sliding_window=False,
    )  # fmt: skip
    cases: list[tuple[str, int, Callable[[], Any]]] = [
        (
            "Qwen3-TTS codec decoder (sliding window 72, 4 rows)",
            declared(QWEN3_TTS, BATCH),
            lambda: fill(DynamicCache(config=sliding), qwen, BATCH, window, 4),
        ),
        (
            "MiMo-Audio local transformer (11 positions, 4 rows)",
            declared(MIMO_AUDIO, BATCH),
            lambda: fill(DynamicCache(), mimo, BATCH, mimo.physical_capacity_positions, 0),
        ),
        (
            "MiniCPM-o Whisper encoder (1500 frames, 1 session)",
            declared(MINICPM_O, 1),
            lambda: encoder_decoder(EncoderDecoderCache(DynamicCache(), DynamicCache()), minicpm),
        ),
        (
            "ming_flash_omni talker (StaticCache 2048, 1 row)",
            declared(MING_FLASH_OMNI, 1),
            lambda: fill(StaticCache(config=static, max_cache_len=ming.physical_capacity_positions), ming, 1, 1, 0),
        ),
    ]

    def encoder_decoder(cache: Any, spec: Any) -> Any:
        return fill(cache, spec, 1, spec.physical_capacity_positions, 0, target=cache.cross_attention_cache)

    for name, declared_bytes, build in cases:
        with allocated_delta(torch, device) as delta:
            cache = build()
        measured = measure_cache_bytes(cache)
        seen = observed()
        allocated, requested = delta()
        tensors = 2 * measured.allocated_layers
        metadata = metadata_bytes(cache)
        yield Row(name, declared_bytes, measured.allocated_bytes, seen, allocated, requested, tensors, metadata)
        del cache


def metadata_bytes(cache: Any) -> int:
    """The storage of the tensors a cache's layers hold beside their keys and values (transformers 5.17: a static
    layer's int64 `cumulative_length`, a sliding layer's `_sliding_window_tensor`), each once."""
    import torch

    halves = [
        getattr(cache, name) for name in ("self_attention_cache", "cross_attention_cache") if hasattr(cache, name)
    ]
    layers = [layer for part in (halves or [cache]) for layer in part.layers]
    storages = {
        value.untyped_storage().data_ptr(): value.untyped_storage().nbytes()
        for layer in layers
        for name, value in vars(layer).items()
        if isinstance(value, torch.Tensor) and name not in ("keys", "values")
    }
    return sum(storages.values())


@contextmanager
def allocated_delta(torch: Any, device: Any) -> Iterator[Callable[[], tuple[int | None, int | None]]]:
    """The allocator's allocated and requested bytes after the block minus before (temporaries freed), or None
    off CUDA."""
    cuda = device.type == "cuda"
    keys = ("allocated_bytes.all.current", "requested_bytes.all.current")

    def figures() -> tuple[int, int]:
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats(device)
        return stats[keys[0]], stats[keys[1]]

    before = figures() if cuda else (0, 0)
    result: list[tuple[int | None, int | None]] = [(None, None)]
    yield lambda: result[0]
    if cuda:
        after = figures()
        result[0] = (after[0] - before[0], after[1] - before[1])


def print_table(rows: list[Row]) -> None:
    headers = ("case", "declared", "storage", "observed", "metadata", "cuda allocated", "cuda requested")
    cells = [
        (r.case, *(str(figure) for figure in (r.declared, r.storage, r.observed, r.metadata)),
         *("-" if figure is None else str(figure) for figure in (r.allocated, r.requested)))
        for r in rows
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in [headers, *cells]) for i in range(len(headers))]
    for row in [headers, tuple("-" * w for w in widths), *cells]:
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    print("bytes; declared = the reference declaration x rows; storage = measure_cache_bytes (the tracker's")
    print("measurement); a sliding layer's storage holds its whole window (72 positions where 71 are declared).")
    print("metadata: the cache's tensors beside K and V (not KV, not counted); cuda requested: what was asked of")
    print("torch's allocator (must be storage + metadata); allocated adds its rounding and the unsplit remainders")
    print("(up to 1 MiB) of cached blocks it reused.")


def raw_pool(torch: Any) -> list[str]:
    """A model-local KV pool of plain tensors in a declaring module's state (VibeVoice's form: one bf16
    [pages, kv heads, page, 2 x head dim] tensor per layer beside an int32 block table), observed by rule 1 of
    plugin/observe/holders.py, against what the device allocated for the pool alone. The failures, if any."""
    from types import SimpleNamespace

    from torch import nn

    from kv_exporter.manifest import Declaration
    from kv_exporter.plugin import observe
    from kv_exporter.protocol import ModelLocalKVScope, ModelLocalKVSpec, RowDriver

    device = torch.device("cuda", torch.cuda.current_device())
    layers, heads, head_dim, pages, page = 4, 8, 128, 64, 16
    spec = ModelLocalKVSpec(
        name="negative_pool", layers=layers, kv_heads=heads, head_dim=head_dim, dtype=torch.bfloat16,
        physical_capacity_positions=pages * page // BATCH, capacity_source="pages per slot",
        scope=ModelLocalKVScope.MODEL, rows=RowDriver.MAX_NUM_SEQS,
    )  # fmt: skip
    root: Any = nn.Module()
    with allocated_delta(torch, device) as pool_delta:
        shape = (pages, heads, page, 2 * head_dim)
        kv = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    allocated = pool_delta()[1]  # requested: what the pool asked for
    pool = SimpleNamespace(kv_caches=kv, block_tables=torch.arange(pages, dtype=torch.int32, device=device))
    root.negative_kv = pool  # a plain attribute, as VibeVoice's root holds its pool
    observe.attach(root, [Declaration.from_spec("", spec)], device)
    owners = {owner.owner: owner.bytes for owner in observe.observe(pause=lambda: None).owners}
    declared = Declaration.from_spec("", spec).bytes_per_row * BATCH
    print(f"raw pool (rule 1): declared {declared}, observed {owners.get('')}, cuda requested for the pool {allocated}")
    failures = []
    if owners.get("") != allocated or allocated != declared:
        failures.append(f"raw pool: observed {owners.get('')}, allocated {allocated}, declared {declared}")
    return failures


def allocator_figures(torch: Any) -> list[str]:
    """The observation's allocator figures (plugin/observe/cuda.py) against torch's own counters, step by step: the
    end of warm-up, memory no cache explains, a burst freed between two samples, a quiet interval, an out-of-memory
    error. The allocator's peak must never be reset by kv-exporter. The failures, if any."""
    from torch import nn

    from kv_exporter.plugin import observe
    from kv_exporter.sidecar.observed import CudaView

    device = torch.device("cuda", torch.cuda.current_device())
    observe.attach(nn.Linear(8, 8).to(device), [], device)
    failures: list[str] = []
    table: list[tuple[str, str, str]] = []

    def check(step: str, name: str, ours: int | None, truth: int | None, ok: bool) -> None:
        table.append((f"{step}: {name}", str(ours), str(truth)))
        if not ok:
            failures.append(f"allocator, {step}: {name} is {ours}, torch says {truth}")

    def sample(warm_up_ended: bool = False) -> Any:
        torch.cuda.synchronize()
        observation = observe.observe(pause=lambda: None, warm_up_ended=warm_up_ended)
        if observation.cuda is None:
            raise RuntimeError(f"no allocator figures on CUDA: {observation.cuda_unavailable}")
        return observation

    def unexplained(observation: Any) -> int | None:
        view = CudaView(None, None, None)  # type: ignore[arg-type]  # the sidecar's own arithmetic, one worker
        view.add(observation.cuda, sum(owner.bytes for owner in observation.owners), detailed=True)
        return view.unexplained_growth_bytes

    warm = sample(warm_up_ended=True).cuda
    allocated = torch.cuda.memory_allocated(device)
    check("warm-up end", "warm.allocated", warm.warm.allocated_bytes, allocated, warm.warm.allocated_bytes == allocated)
    held = torch.empty(256 << 20, dtype=torch.uint8, device=device)  # no cache holds it: unexplained
    burst = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    del burst
    peak = torch.cuda.max_memory_allocated(device)
    after_burst = sample()
    cuda = after_burst.cuda
    check("burst freed", "high_water", cuda.high_water_bytes, peak, cuda.high_water_bytes == peak)
    check("burst freed", "high_water_floor", cuda.high_water_floor_bytes, peak, cuda.high_water_floor_bytes == peak)
    growth = unexplained(after_burst)
    check("burst freed", "unexplained growth", growth, held.numel(), growth == held.numel())
    quiet = sample().cuda
    allocated = torch.cuda.memory_allocated(device)
    exact = quiet.high_water_bytes == quiet.high_water_floor_bytes == allocated
    check("quiet interval", "high_water (= floor)", quiet.high_water_bytes, allocated, exact)
    stats = torch.cuda.memory_stats(device)
    with contextlib.suppress(torch.OutOfMemoryError):
        torch.empty(torch.cuda.get_device_properties(device).total_memory * 2, dtype=torch.uint8, device=device)
    after_oom = sample().cuda
    oomed = torch.cuda.memory_stats(device)
    check(
        "out of memory",
        "ooms",
        after_oom.ooms,
        oomed["num_ooms"],
        after_oom.ooms == oomed["num_ooms"] == stats["num_ooms"] + 1,
    )
    retries = oomed["num_alloc_retries"]
    check("out of memory", "alloc_retries", after_oom.alloc_retries, retries, after_oom.alloc_retries == retries)
    never_reset = torch.cuda.max_memory_allocated(device)
    check("end", "peak (never reset)", after_oom.peak_bytes, never_reset, after_oom.peak_bytes == never_reset >= peak)
    del held
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    print(f"{'allocator check':<{widths[0]}}  {'kv-exporter':>{widths[1]}}  {'torch':>{widths[2]}}")
    for step, ours, truth in table:
        print(f"{step:<{widths[0]}}  {ours:>{widths[1]}}  {truth:>{widths[2]}}")
    return failures


def sidecar_on_nvml(torch: Any) -> list[str]:
    """The sidecar on real NVML over this process's manifest; the failures, if any."""
    try:
        import prometheus_client  # noqa: F401
        import pynvml  # noqa: F401  (nvidia-ml-py)
    except ImportError as exc:
        print(f"gpu-proof: sidecar part skipped: {exc.name} is not installed in this Python")
        return []
    from types import SimpleNamespace

    from kv_exporter.gpu import NvmlReader
    from kv_exporter.manifest import Declaration, EngineIdentity, Manifest, Phase, ProcessInfo, write_manifest
    from kv_exporter.plugin import baseline, identity, observe
    from kv_exporter.reference import QWEN3_TTS

    runner = SimpleNamespace(device=torch.device("cuda", torch.cuda.current_device()))
    device, base = baseline.measure(runner, identity.device_info(runner), NvmlReader())
    manifest = Manifest(
        engine=EngineIdentity(model_name="gpu-proof"),
        process=ProcessInfo.current(),
        device=device,
        max_num_seqs=BATCH,
        phase=Phase.WARMUP,
        collector="kv_exporter",
        declarations=tuple(Declaration.from_spec(o, s) for o, s in QWEN3_TTS.declarations),
        baseline=base,
        observation=observe.observe(pause=lambda: None),
    )
    folder = Path(tempfile.mkdtemp(prefix="kvx-gpu-proof-"))
    write_manifest(folder, manifest)
    text = scrape_sidecar(folder)
    series = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
    failures = []
    labels = [k for k in series if k.startswith("model_local_kv_ceiling_bytes{")]
    exported_gpu = {part.split("=")[1].strip('"') for k in labels for part in k[k.index("{") + 1 : -1].split(",")
                    if part.startswith("gpu=")}  # fmt: skip
    print(f"manifest device: UUID {device.uuid}, NVML index {device.index}; sidecar's gpu label(s): {exported_gpu}")
    if device.index is None or exported_gpu != {str(device.index)}:
        failures.append("the sidecar's gpu label is not NVML's index for torch's UUID")
    process = [v for k, v in series.items() if k.startswith("model_local_kv_gpu_process_memory_bytes{")
               and f'pid="{os.getpid()}"' in k]  # fmt: skip
    reserved = torch.cuda.memory_reserved()
    print(f"NVML used by this pid: {process[0] if process else 'not matched'} B; torch reserved: {reserved} B")
    print(f"manifest baseline: NVML {base.nvml_process_used_bytes} B, torch reserved {base.torch_reserved_bytes} B")
    if process and process[0] < reserved:
        failures.append("NVML reports less for this process than torch has reserved")
    failures += nvml_memory_versions(series, device.index)
    peak = [v for k, v in series.items() if k.startswith("model_local_kv_observed_cuda_peak_bytes{")]
    print(f"exported allocator peak: {peak}; torch.cuda.max_memory_allocated: {torch.cuda.max_memory_allocated()}")
    if peak != [torch.cuda.max_memory_allocated()]:
        failures.append("the sidecar's model_local_kv_observed_cuda_peak_bytes is not the worker's allocator peak")
    return failures


def nvml_memory_versions(series: dict[str, float], index: int | None) -> list[str]:
    """NVML's version 1 and version 2 memory figures side by side, and what the sidecar exported of them."""
    import pynvml

    if index is None:
        return ["no NVML index for this device"]
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    except pynvml.NVMLError as exc:
        print(f"NVML v1 total/used/free {v1.total}/{v1.used}/{v1.free}; no version 2 memory call here ({exc})")
        return []
    print(f"NVML v1 total/used/free {v1.total}/{v1.used}/{v1.free}")
    print(f"NVML v2 total/reserved/used/free {v2.total}/{v2.reserved}/{v2.used}/{v2.free}")
    exported = {name: [v for k, v in series.items() if k.startswith(f"model_local_kv_gpu_memory_{name}_bytes{{")]
                for name in ("used", "reserved", "free", "total")}  # fmt: skip
    print(f"sidecar exported: {exported}")
    failures = []
    if v2.total != v2.reserved + v2.used + v2.free:
        failures.append("NVML v2: total != reserved + used + free")
    if exported["reserved"] != [v2.reserved]:
        failures.append("the sidecar does not export NVML v2's reserved memory")
    if v1.total - v1.free != v2.total - v2.free or len(exported["used"]) != 1:  # the same occupancy both ways
        failures.append("NVML v1 and v2 disagree on what is occupied (or the sidecar exported no used figure)")
    return failures


def scrape_sidecar(folder: Path) -> str:
    log = folder / "sidecar.log"
    with log.open("wb") as out:
        command = [sys.executable, "-m", "kv_exporter", "serve", "--manifest-dir", str(folder)]
        process = subprocess.Popen([*command, "--web.listen-address", "127.0.0.1:0"], cwd=REPO, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while "serving http://" not in log.read_text(errors="replace"):
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(log.read_text(errors="replace"))
            time.sleep(0.1)
        url = log.read_text().split("serving ", 1)[1].split(" ", 1)[0]
        body: bytes = urllib.request.urlopen(url, timeout=30).read()
        return body.decode()
    finally:
        process.terminate()
        process.wait(20)


if __name__ == "__main__":
    sys.exit(main())
