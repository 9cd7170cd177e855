"""The worker's torch CUDA allocator, read at each sample: what it holds now, the most it held since the previous
sample, its retries and out-of-memory failures, what it held when the engine's warm-up ended, and its per-process cap.

One `torch.cuda.memory_stats(device)` call gives the figures (host-side counters, no device synchronisation, ~0.1 ms);
`get_per_process_memory_fraction(device)` the cap (set by vLLM 0.34's extensible KV cache, or by anyone), times the
device's total from `mem_get_info` (read once): torch's allocator refuses to reserve past it, whatever NVML shows free.
The allocator's peak is never reset here: vLLM's profiler resets it and reads it back to size the KV budget, and
other tools read it too. So the most allocated since the previous sample is bounded, not measured (see
`kv_exporter.observation.CudaMemory`): exact whenever the peak rose in between, which is when it matters most.

Those four `torch.cuda` functions are the whole boundary (`AllocatorApi`): tests stand in for it alone, with torch's
own answers and error classes (tests/support/fake_cuda.py).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kv_exporter.observation import AllocatorLimitAbsent, CudaMemory, CudaUnavailable, CudaWarm
from kv_exporter.plugin.forksafe import ForkSafeLock
from kv_exporter.plugin.oncelog import warn_once


class AllocatorApi(Protocol):
    """The calls of `torch.cuda` this module makes, under their own names (the module itself is one)."""

    def is_initialized(self) -> bool: ...

    def memory_stats(self, device: int) -> Mapping[str, Any]: ...

    def get_per_process_memory_fraction(self, device: int) -> float: ...

    def mem_get_info(self, device: int) -> tuple[int, int]: ...


ALLOCATED = "allocated_bytes.all.current"
ALLOCATED_PEAK = "allocated_bytes.all.peak"
ALLOCATED_EVER = "allocated_bytes.all.allocated"  # every byte ever allocated: what may have come and gone
RESERVED = "reserved_bytes.all.current"
RETRIES = "num_alloc_retries"
OOMS = "num_ooms"
_KEYS = (ALLOCATED, ALLOCATED_PEAK, ALLOCATED_EVER, RESERVED, RETRIES, OOMS)


@dataclass(frozen=True)
class _Reading:
    allocated: int
    peak: int
    allocated_ever: int


class CudaAllocator:
    """The allocator figures of one worker's CUDA device (index fixed by `attach`, in the worker's own thread: CUDA's
    current device is per thread, and asking from the sampler's would name, and might initialise, device 0)."""

    def __init__(self, api: AllocatorApi | None = None) -> None:
        self._api = api  # None: torch.cuda, once torch is imported
        self._total: int | None = None  # the device's total as the cap counts it (mem_get_info), read once
        self.device_index: int | None = None
        self.device_kind: str | None = None  # "cuda", "cpu", "unknown" (identity.visible_device); None: not attached
        self.warm: CudaWarm | None = None
        self._previous: _Reading | None = None
        self._lock = ForkSafeLock()  # the sampler's thread and the worker's (a publish) both read

    def attach(self, device: object) -> None:
        from kv_exporter.plugin.identity import visible_device  # only a process that loads a model gets here

        self.device_kind, self.device_index = visible_device(device)

    def unavailable_reason(self) -> CudaUnavailable | None:
        """Why there are no figures now (None when there are)."""
        if self.device_kind is None:
            return CudaUnavailable.NOT_ATTACHED
        if self.device_kind != "cuda":
            return CudaUnavailable.NOT_CUDA
        api = self.api()
        if api is None or self.device_index is None:
            return CudaUnavailable.NO_INDEX
        if not api.is_initialized():
            return CudaUnavailable.NOT_INITIALISED
        return None

    def api(self) -> AllocatorApi | None:
        if self._api is None:
            torch: Any = sys.modules.get("torch")
            return None if torch is None else torch.cuda
        return self._api

    def mark_warm(self, observed_bytes: int) -> None:
        """The engine's warm-up ended: keep the figures later growth is measured from."""
        stats = self._stats()
        if stats is not None:
            self.warm = CudaWarm(stats[ALLOCATED], stats[RESERVED], stats[ALLOCATED_PEAK], observed_bytes)

    def read(self) -> CudaMemory | None:
        """The figures now, the high-water since the previous `read` bounded; None where unavailable (the reason:
        `unavailable_reason`, or STATS_FAILED where torch failed to answer: warned once)."""
        with self._lock:
            stats = self._stats()
            if stats is None:
                return None
            now = _Reading(stats[ALLOCATED], stats[ALLOCATED_PEAK], stats[ALLOCATED_EVER])
            floor, ceiling = high_water_bounds(self._previous, now)
            self._previous = now
            limit, absent = self._limit()
        return CudaMemory(
            allocated_bytes=now.allocated,
            reserved_bytes=stats[RESERVED],
            peak_bytes=now.peak,
            high_water_bytes=ceiling,
            high_water_floor_bytes=floor,
            alloc_retries=stats[RETRIES],
            ooms=stats[OOMS],
            warm=self.warm,
            limit_bytes=limit,
            limit_absent=absent,
        )

    def _limit(self) -> tuple[int | None, AllocatorLimitAbsent | None]:
        """The per-process cap in bytes, or why there is none. torch answers 1.0 where no cap was set."""
        api = self.api()
        assert api is not None and self.device_index is not None  # figures were read: attached to a CUDA device
        if not hasattr(api, "get_per_process_memory_fraction"):
            return None, AllocatorLimitAbsent.UNSUPPORTED
        try:
            fraction = float(api.get_per_process_memory_fraction(self.device_index))
            if fraction >= 1.0:
                return None, AllocatorLimitAbsent.NO_CAP
            if self._total is None:
                self._total = int(api.mem_get_info(self.device_index)[1])
        except Exception as exc:
            warn_once("observe:cuda-limit", "kv-exporter: torch cannot report its memory cap (%s)", repr(exc))
            return None, AllocatorLimitAbsent.READ_FAILED
        return cap_bytes(fraction, self._total), None

    def _stats(self) -> dict[str, int] | None:
        api, index = self.api(), self.device_index
        if self.unavailable_reason() is not None or api is None or index is None:
            return None
        try:
            stats = api.memory_stats(index)
            return {key: int(stats.get(key, 0)) for key in _KEYS}
        except Exception as exc:
            warn_once(
                "observe:cuda", "kv-exporter: torch cannot report CUDA memory (%s); observing without it", repr(exc)
            )
            return None


def high_water_bounds(previous: _Reading | None, now: _Reading) -> tuple[int, int]:
    """(at least, at most) the most allocated between `previous` and `now`; the first time, since the allocator's
    peak was last reset (that peak, exactly).

    A peak that rose since `previous` was reached in between: it is the high-water. An unchanged peak bounds it, and so
    does the previous figure plus every byte allocated since (frees only lower it). A peak below the previous one was
    reset in between (by vLLM's profiler): it was reached after the reset, and what came before is bounded as above."""
    if previous is None or now.peak > previous.peak:
        return now.peak, now.peak
    floor = max(previous.allocated, now.allocated)
    ceiling = previous.peak
    if now.allocated_ever >= previous.allocated_ever:  # else the cumulative counters were reset: the peak alone
        ceiling = min(ceiling, previous.allocated + now.allocated_ever - previous.allocated_ever)
    if now.peak < previous.peak:
        floor, ceiling = max(floor, now.peak), max(ceiling, now.peak)
    return floor, max(floor, ceiling)


def cap_bytes(fraction: float, total: int) -> int:
    """The bytes torch's allocator may reserve under `fraction` of a device of `total` bytes, as it computes them
    (`set_per_process_memory_fraction`: the fraction times the total, truncated)."""
    return max(0, int(fraction * total))
