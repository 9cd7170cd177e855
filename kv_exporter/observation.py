"""What the caches really hold, as one worker measured it: the observed half of the manifest contract.

The hook's sampler (`kv_exporter.plugin`) produces an `Observation` every `KV_EXPORTER_OBSERVE_INTERVAL` seconds; it
travels in the worker's manifest; the sidecar exports it beside the declarations. Declared figures say what a model
claims; these say what its live model-local KV holds (`transformers` cache objects, and the other forms
`kv_exporter.plugin.observe.holders` counts), so a wrong claim shows as a difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Annotated, ClassVar

from kv_exporter.document import Doc, DocumentError, Prose, Range, Since, decode

# Bounds no real worker reaches: a figure beyond them is a corrupt or hostile document, never exported.
MAX_OBSERVED_BYTES = 1 << 50  # 1 PiB
MAX_OBSERVED_CACHES = 10_000_000
MAX_INTERVAL_S = 86_400

Bytes = Annotated[int, Range(0, MAX_OBSERVED_BYTES)]

# An owner's peak where none was measured (a version 2 document): the figure at the sample.
PEAK_AT_SAMPLE = -1

# Caches created where no module of the model can be found (outside any forward, in a thread of their own).
UNATTRIBUTED_OWNER = "unattributed"


class ObservationState(str, Enum):
    """Whether the figures are there, and if not, why; the sidecar exports the state, never a silent absence."""

    OK = "ok"  # the figures below are a measurement
    OFF = "off"  # KV_EXPORTER_OBSERVE_INTERVAL=0
    UNAVAILABLE = "unavailable"  # observation cannot work in this process (no transformers, no weak references, ...)
    FAILING = "failing"  # it worked or should work, and the last sample failed


class UnreadableReason(str, Enum):
    """Why the sampler could not read a cache (it is left out of its owner's figures and counted here instead)."""

    NO_LAYERS = "no_layers"  # neither .layers nor an encoder-decoder cache's two halves
    LAYERS_RAISED = "layers_raised"  # reading its layers raised
    NOT_A_TENSOR = "not_a_tensor"  # a layer's keys or values hold something other than a tensor
    NO_STORAGE = "no_storage"  # a tensor without a readable storage (sparse, nested, a wrapper)
    NOT_FOLLOWED = "not_followed"  # its class's methods cannot be followed (one is no plain function)

    __since__: ClassVar[dict[str, int]] = {"not_followed": 5}  # the schema version that added each later one


class CudaUnavailable(str, Enum):
    """Why an observation has no allocator figures (a metric label)."""

    NOT_ATTACHED = "not_attached"  # the model is not loaded yet: the worker's device is unknown
    NOT_CUDA = "not_cuda"  # the worker's device is not a CUDA one (a CPU worker): torch's CUDA allocator holds nothing
    NO_INDEX = "no_index"  # a CUDA device whose index could not be told
    NOT_INITIALISED = "not_initialised"  # CUDA not initialised in the process
    STATS_FAILED = "stats_failed"  # torch.cuda.memory_stats raised (warned once in the worker's log)


class AllocatorLimitAbsent(str, Enum):
    """Why allocator figures come without a per-process cap (a metric label). Without figures at all, the reason is
    `CudaUnavailable`'s."""

    NO_CAP = "no_cap"  # get_per_process_memory_fraction answers 1.0: none was set (or the whole device was allowed)
    UNSUPPORTED = "unsupported"  # a torch without get_per_process_memory_fraction
    READ_FAILED = "read_failed"  # the call raised (warned once in the worker's log)


@dataclass(frozen=True)
class OwnerObservation:
    """One owner's live caches: storage bytes (each storage counted once) and how many cache objects hold them.

    `bytes` is what they held when the sample was taken; `peak_bytes` the most they held at any instant since the
    previous sample (schema version 3; read from version 2 as `bytes`, the only figure it had)."""

    owner: Annotated[str, Doc("a declaring owner's path in named_modules(), another module's path, or 'unattributed'")]
    bytes: Bytes
    caches: Annotated[int, Range(0, MAX_OBSERVED_CACHES)]
    peak_bytes: Annotated[
        Bytes, Since(3), Doc("the most the owner's caches held since the previous sample, >= bytes")
    ] = PEAK_AT_SAMPLE

    def __post_init__(self) -> None:
        if self.peak_bytes == PEAK_AT_SAMPLE:
            object.__setattr__(self, "peak_bytes", self.bytes)
        elif self.peak_bytes < self.bytes:
            raise DocumentError(
                "inconsistent", f"owner {self.owner!r}: peak_bytes {self.peak_bytes} < bytes {self.bytes}"
            )


@dataclass(frozen=True)
class UnreadableCaches:
    """Caches of one owner the sampler could not read, for one reason: left out of the owner's figures."""

    owner: Annotated[str, Doc("as in owners")]
    reason: UnreadableReason
    caches: Annotated[int, Range(1, MAX_OBSERVED_CACHES)]


Count = Annotated[int, Range(0)]

# The schema version that added the allocator's peak, high-water bounds, retries, OOMs and warm-up figures.
CUDA_DETAILS_SINCE = 4
_DETAILED = Since(CUDA_DETAILS_SINCE)


@dataclass(frozen=True)
class CudaWarm:
    """The allocator's figures when the engine's warm-up ended (its KV budget sized, its graphs captured), and what
    the worker's observed model-local KV held then: what later growth is measured from."""

    allocated_bytes: Bytes
    reserved_bytes: Bytes
    peak_bytes: Bytes
    observed_bytes: Annotated[Bytes, Doc("the owners' observed bytes, summed, at the end of warm-up")]


@dataclass(frozen=True)
class CudaMemory:
    """torch's caching-allocator figures for the worker's device (`torch.cuda.memory_stats`, host-side counters).

    kv-exporter never resets the allocator's peak (vLLM's profiler does, and reads it): the most allocated since the
    previous sample is bounded instead. `high_water_bytes` bounds it from above: the allocator's peak where it rose
    since the previous sample (then exact), else the smaller of the unchanged peak and the previous sample's allocated
    plus everything allocated since; `high_water_floor_bytes` from below: the larger of the two samples' allocated.
    Where the two are equal the high-water is exact."""

    allocated_bytes: Bytes
    reserved_bytes: Bytes
    peak_bytes: Annotated[
        Bytes, _DETAILED, Doc("the most allocated since the allocator's peak was last reset (by vLLM, never by us)")
    ] = 0
    high_water_bytes: Annotated[Bytes, _DETAILED, Doc("the most allocated since the previous sample, at most")] = 0
    high_water_floor_bytes: Annotated[
        Bytes, _DETAILED, Doc("the most allocated since the previous sample, at least")
    ] = 0
    alloc_retries: Annotated[Count, _DETAILED, Doc("allocations that failed, freed the cache and were retried")] = 0
    ooms: Annotated[Count, _DETAILED, Doc("allocations that failed for good: out of memory")] = 0
    warm: Annotated[CudaWarm | None, _DETAILED, Doc("at the end of warm-up; null before it or where unseen")] = None
    limit_bytes: Annotated[
        Bytes | None,
        Since(5),
        Doc(
            "the allocator's per-process cap (torch.cuda.get_per_process_memory_fraction x the device's total): an "
            "allocation that would take reserved_bytes past it fails; null where none is set (why: limit_absent)"
        ),
    ] = None
    limit_absent: Annotated[
        AllocatorLimitAbsent | None, Since(5), Doc("why limit_bytes is null; null when it is set")
    ] = None

    def contradiction(self, schema_version: int) -> str:
        """What torch's allocator could never report together ("": nothing): more allocated than reserved, or, in a
        document of `schema_version` that reports them (CUDA_DETAILS_SINCE on), than its peak, or a high-water below
        its floor. The sidecar refuses such figures rather than export them."""
        if self.reserved_bytes < self.allocated_bytes:
            return f"reserved_bytes {self.reserved_bytes} < allocated_bytes {self.allocated_bytes}"
        if schema_version < CUDA_DETAILS_SINCE:
            return ""
        if self.peak_bytes < self.allocated_bytes:
            return f"peak_bytes {self.peak_bytes} < allocated_bytes {self.allocated_bytes}"
        if self.high_water_bytes < self.high_water_floor_bytes:
            return f"high_water_bytes {self.high_water_bytes} < high_water_floor_bytes {self.high_water_floor_bytes}"
        if self.limit_bytes is not None and self.limit_absent is not None:
            return f"limit_bytes {self.limit_bytes} with a reason for its absence ({self.limit_absent.value})"
        return ""


@dataclass(frozen=True)
class Observation:
    state: ObservationState
    reason: Annotated[str, Prose()]  # why the state is not OK; "" when it is
    interval_s: Annotated[float, Range(0, MAX_INTERVAL_S), Doc("how often the worker samples, seconds (0: off)")]
    taken_at: Annotated[float, Range(0), Doc("Unix time of the sample, seconds (0: none taken)")]
    duration_s: Annotated[float, Range(0, MAX_INTERVAL_S), Doc("wall time the sample took, seconds")]
    owners: tuple[OwnerObservation, ...] = ()
    cuda: CudaMemory | None = None  # only on a CUDA device
    unreadable: Annotated[tuple[UnreadableCaches, ...], Since(3)] = ()
    peaks_followed: Annotated[
        bool,
        Since(3),
        Doc("whether the owners' peak_bytes were followed between samples (KV_EXPORTER_OBSERVE_PEAK); else bytes"),
    ] = False
    cuda_unavailable: Annotated[
        CudaUnavailable | None, _DETAILED, Doc("why `cuda` is null; null when it is set (or observation is off)")
    ] = None


@dataclass(frozen=True)
class ObservationProblem:
    """Why a manifest's observation (or its allocator figures alone) was not used; the declarations are still read."""

    reason: str
    detail: str


def read_observation(raw: object, version: int) -> Observation:
    """An observation document of schema `version`, without its allocator figures (`read_allocator` reads those
    apart: bad ones cost only them). Raises DocumentError."""
    without_cuda = {**raw, "cuda": None} if isinstance(raw, dict) and raw.get("cuda") is not None else raw
    observation = decode(Observation, without_cuda, "observation", version=version)
    owners = [owner.owner for owner in observation.owners]
    if len(set(owners)) != len(owners):
        repeated = sorted({owner for owner in owners if owners.count(owner) > 1})
        raise DocumentError("duplicate_owner", f"observation lists owner(s) {', '.join(map(repr, repeated))} twice")
    return observation


def read_allocator(raw: object, version: int) -> CudaMemory:
    """An observation's allocator figures; DocumentError for ones torch's allocator could never give together."""
    cuda = decode(CudaMemory, raw, "observation.cuda", version=version)
    contradiction = cuda.contradiction(version)
    if contradiction:
        raise DocumentError("inconsistent", contradiction)
    return cuda
