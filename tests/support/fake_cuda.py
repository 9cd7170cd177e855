"""A stand-in for torch's CUDA caching allocator where there is no GPU: the one other faked boundary beside NVML.

It answers the calls `kv_exporter.plugin.observe.cuda.AllocatorApi` names, under torch.cuda's own names, signatures
and error classes, plus the setter vLLM 0.34 calls (`set_per_process_memory_fraction`) and `reserve`, which refuses
to reserve past the cap as torch's allocator does (torch.OutOfMemoryError, counted in num_ooms). Nothing else of
torch is faked: models, caches and vLLM's classes stay real. `patch_torch` puts it in torch.cuda's place for code
(vLLM's) that calls torch.cuda directly; the GPU proof (`make gpu-proof`) checks the same figures on a real device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

STATS_KEYS = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "allocated_bytes.all.allocated",
    "reserved_bytes.all.current",
    "num_alloc_retries",
    "num_ooms",
)


@dataclass
class FakeCuda:
    """One CUDA device's allocator in one process. `compiled=False`: a CPU-only build of torch."""

    total: int
    initialized: bool = True
    compiled: bool = True
    allocated: int = 0
    reserved: int = 0
    peak: int = 0
    allocated_ever: int = 0
    retries: int = 0
    ooms: int = 0
    fraction: float | None = None  # None: never set (torch answers 1.0)
    others_use: int = 0  # other processes' memory on the device: what mem_get_info's free leaves out

    def _lazy_init(self) -> None:
        if not self.compiled:
            raise AssertionError("Torch not compiled with CUDA enabled")  # torch.cuda._lazy_init's own error

    def _check(self, device: Any) -> None:
        index = device.index if isinstance(device, torch.device) else device
        if index not in (0, None):
            raise RuntimeError(f"Invalid device argument {index}: did you call init?")

    def is_initialized(self) -> bool:
        return self.compiled and self.initialized

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        if not self.is_initialized():
            return {}  # torch's answer before CUDA is initialised
        self._check(device)
        figures = (self.allocated, self.peak, self.allocated_ever, self.reserved, self.retries, self.ooms)
        return dict(zip(STATS_KEYS, figures, strict=True))

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        self._lazy_init()
        self._check(device)
        return 1.0 if self.fraction is None else self.fraction

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        self._lazy_init()
        self._check(device)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fraction = fraction

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self._lazy_init()
        self._check(device)
        return self.total - self.reserved - self.others_use, self.total

    @property
    def cap(self) -> int:
        return self.total if self.fraction is None else int(self.fraction * self.total)

    def reserve(self, nbytes: int) -> None:
        """Allocate `nbytes` in a segment of its own, as torch does for a large tensor: past the cap (or the device)
        it fails as torch's allocator fails, with torch.OutOfMemoryError."""
        if self.reserved + nbytes > self.cap or self.reserved + nbytes + self.others_use > self.total:
            self.ooms += 1
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {nbytes} bytes. {self.reserved} bytes reserved by PyTorch, "
                f"limit {self.cap}"
            )
        self.reserved += nbytes
        self.allocated += nbytes
        self.allocated_ever += nbytes
        self.peak = max(self.peak, self.allocated)


CALLS = ("is_initialized", "memory_stats", "get_per_process_memory_fraction", "set_per_process_memory_fraction")


@contextmanager
def patch_torch(fake: FakeCuda) -> Iterator[FakeCuda]:
    """torch.cuda's allocator calls (and torch.accelerator.get_memory_info, which vLLM 0.34 divides the cap by)
    answered by `fake` for the duration."""
    saved = {name: getattr(torch.cuda, name) for name in (*CALLS, "mem_get_info")}
    accelerator = getattr(torch, "accelerator", None)
    saved_info = getattr(accelerator, "get_memory_info", None)
    for name in CALLS:
        setattr(torch.cuda, name, getattr(fake, name))
    torch.cuda.mem_get_info = fake.mem_get_info
    if accelerator is not None:
        accelerator.get_memory_info = fake.mem_get_info
    try:
        yield fake
    finally:
        for name, call in saved.items():
            setattr(torch.cuda, name, call)
        if accelerator is not None and saved_info is not None:
            accelerator.get_memory_info = saved_info
