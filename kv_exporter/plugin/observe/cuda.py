"""The worker's torch CUDA allocator, read at each sample: what it holds now, the most it held since the previous
sample, its retries and out-of-memory failures, and what it held when the engine's warm-up ended.

One `torch.cuda.memory_stats(device)` call gives everything (host-side counters, no device synchronisation, ~0.1 ms).
The allocator's peak is never reset here: vLLM's profiler resets it and reads it back to size the KV budget, and
other tools read it too. So the most allocated since the previous sample is bounded, not measured (see
`kv_exporter.observation.CudaMemory`): exact whenever the peak rose in between, which is when it matters most.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from kv_exporter.observation import CudaMemory, CudaUnavailable, CudaWarm
from kv_exporter.plugin.forksafe import ForkSafeLock
from kv_exporter.plugin.oncelog import warn_once

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

    def __init__(self) -> None:
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
        torch: Any = sys.modules.get("torch")
        if torch is None or self.device_index is None:
            return CudaUnavailable.NO_INDEX
        if not torch.cuda.is_initialized():
            return CudaUnavailable.NOT_INITIALISED
        return None

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
        return CudaMemory(
            allocated_bytes=now.allocated,
            reserved_bytes=stats[RESERVED],
            peak_bytes=now.peak,
            high_water_bytes=ceiling,
            high_water_floor_bytes=floor,
            alloc_retries=stats[RETRIES],
            ooms=stats[OOMS],
            warm=self.warm,
        )

    def _stats(self) -> dict[str, int] | None:
        torch: Any = sys.modules.get("torch")
        if self.unavailable_reason() is not None or torch is None:
            return None
        try:
            stats = torch.cuda.memory_stats(self.device_index)
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
