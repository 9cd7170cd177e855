"""What the caches really hold, as one worker measured it: the observed half of the manifest contract.

The hook's sampler (`kv_exporter.plugin`) produces an `Observation` every `KV_EXPORTER_OBSERVE_INTERVAL` seconds; it
travels in the worker's manifest; the sidecar exports it beside the declarations. Declared figures say what a model
claims; these say what its live `transformers` cache objects hold, so a wrong claim shows as a difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# Caches created where no module of the model can be found (outside any forward, in a thread of their own).
UNATTRIBUTED_OWNER = "unattributed"


class ObservationState(str, Enum):
    """Whether the figures are there, and if not, why; the sidecar exports the state, never a silent absence."""

    OK = "ok"  # the figures below are a measurement
    OFF = "off"  # KV_EXPORTER_OBSERVE_INTERVAL=0
    UNAVAILABLE = "unavailable"  # observation cannot work in this process (no transformers, no weak references, ...)
    FAILING = "failing"  # it worked or should work, and the last sample failed


@dataclass(frozen=True)
class OwnerObservation:
    """One owner's live caches: storage bytes (each storage counted once) and how many cache objects hold them."""

    owner: str  # a declaring owner's path in named_modules(), another module's path, or UNATTRIBUTED_OWNER
    bytes: int
    caches: int


@dataclass(frozen=True)
class CudaMemory:
    """torch's allocator figures for the worker's device: `memory_allocated` and `memory_reserved`."""

    allocated_bytes: int
    reserved_bytes: int


@dataclass(frozen=True)
class Observation:
    state: ObservationState
    reason: str  # why the state is not OK; "" when it is
    interval_s: float  # how often the worker samples (0 when off)
    taken_at: float  # Unix time of the sample (0 when none was taken)
    duration_s: float  # wall time the sample took
    owners: tuple[OwnerObservation, ...] = ()
    cuda: CudaMemory | None = None  # only on a CUDA device
