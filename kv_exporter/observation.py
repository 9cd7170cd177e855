"""What the caches really hold, as one worker measured it: the observed half of the manifest contract.

The hook's sampler (`kv_exporter.plugin`) produces an `Observation` every `KV_EXPORTER_OBSERVE_INTERVAL` seconds; it
travels in the worker's manifest; the sidecar exports it beside the declarations. Declared figures say what a model
claims; these say what its live `transformers` cache objects hold, so a wrong claim shows as a difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Annotated

from kv_exporter.document import Doc, Prose, Range

# Bounds no real worker reaches: a figure beyond them is a corrupt or hostile document, never exported.
MAX_OBSERVED_BYTES = 1 << 50  # 1 PiB
MAX_OBSERVED_CACHES = 10_000_000
MAX_INTERVAL_S = 86_400

Bytes = Annotated[int, Range(0, MAX_OBSERVED_BYTES)]

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

    owner: Annotated[str, Doc("a declaring owner's path in named_modules(), another module's path, or 'unattributed'")]
    bytes: Bytes
    caches: Annotated[int, Range(0, MAX_OBSERVED_CACHES)]


@dataclass(frozen=True)
class CudaMemory:
    """torch's allocator figures for the worker's device: `memory_allocated` and `memory_reserved`."""

    allocated_bytes: Bytes
    reserved_bytes: Bytes


@dataclass(frozen=True)
class Observation:
    state: ObservationState
    reason: Annotated[str, Prose()]  # why the state is not OK; "" when it is
    interval_s: Annotated[float, Range(0, MAX_INTERVAL_S), Doc("how often the worker samples, seconds (0: off)")]
    taken_at: Annotated[float, Range(0), Doc("Unix time of the sample, seconds (0: none taken)")]
    duration_s: Annotated[float, Range(0, MAX_INTERVAL_S), Doc("wall time the sample took, seconds")]
    owners: tuple[OwnerObservation, ...] = ()
    cuda: CudaMemory | None = None  # only on a CUDA device
