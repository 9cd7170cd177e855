"""A scrape's inputs as records: what `inputs` gathers and the snapshot combines (no I/O here).

And where a manifest's declarations sit: `placement` is the one rule that puts a manifest on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from kv_exporter.gpu import SOURCE_SIMULATED, GpuMemory, GpuReadError
from kv_exporter.manifest import Manifest, ManifestError
from kv_exporter.sidecar.engine_page import EngineKey, EnginePage, EnginePageError
from kv_exporter.sidecar.liveness import State, Verdict


class FolderState(Enum):
    """What listing the manifest folder (`--manifest-dir`) found this scrape."""

    OK = "ok"
    MISSING = "missing"  # no such path (or a link to nothing)
    UNREADABLE = "unreadable"  # there, but listing it failed: permissions, I/O
    NOT_A_FOLDER = "not_a_folder"  # a file, a socket, ... where the folder should be


@dataclass(frozen=True)
class ManifestEntry:
    """One manifest file: a valid manifest with its liveness verdict, or why it is invalid."""

    path: str
    manifest: Manifest | None
    verdict: Verdict
    error: ManifestError | None = None

    @property
    def live(self) -> bool:
        return self.verdict.state is State.LIVE


@dataclass(frozen=True)
class PageResult:
    target: str
    page: EnginePage | None
    error: EnginePageError | None
    seconds: float  # how long the collection waited for it
    refused: tuple[EngineKey, ...] = ()  # engines whose impossible running count `page` no longer holds


@dataclass(frozen=True)
class GpuResult:
    """One pass over the GPU reader. `devices` is empty when it could not be read; `error` says why."""

    enabled: bool
    source: str | None
    devices: tuple[GpuMemory, ...] = ()
    processes: dict[int, dict[int, int]] = field(default_factory=dict)  # NVML index -> pid -> bytes
    comparable: frozenset[int] = frozenset()  # NVML indices whose pids are comparable with the manifests' pids
    error: GpuReadError | None = None
    device_errors: tuple[GpuReadError, ...] = ()

    @property
    def up(self) -> bool:
        return self.enabled and self.error is None


DeviceKey = tuple[str, int | None]  # (UUID, None) for a placement by UUID, ("", index) for one by index


@dataclass(frozen=True, slots=True)
class Placement:
    """The GPU a manifest's declarations sit on, as its series label it: `gpu` (the NVML index, "" when unknown) and
    `UUID` ("" when unknown). A device is matched by the UUID when there is one, which then decides alone; else by
    the index."""

    index: int | None
    uuid: str

    @property
    def gpu(self) -> str:
        return "" if self.index is None else str(self.index)

    @property
    def key(self) -> DeviceKey:
        return (self.uuid, None) if self.uuid else ("", self.index)

    def on(self, device: GpuMemory) -> bool:
        return self.key in device_keys(device)


def device_keys(device: GpuMemory) -> tuple[DeviceKey, ...]:
    """The `Placement.key`s that put something on `device`."""
    by_index: DeviceKey = ("", device.index)
    return ((device.uuid, None), by_index) if device.uuid else (by_index,)


def recorded_placement(manifest: Manifest) -> Placement:
    return Placement(manifest.device.index, manifest.device.uuid or "")


def on_device(manifest: Manifest, device: GpuMemory) -> bool:
    """A manifest's GPU by UUID when it recorded one, else by NVML index."""
    return recorded_placement(manifest).on(device)


def placement(manifest: Manifest, gpu: GpuResult) -> Placement:
    """Where a manifest's declarations sit.

    As recorded, except that a simulated device stands in for the GPU of an engine that recorded none (a CPU
    engine in the demo or the end-to-end tests): that is what simulating a device is for. Real NVML readings never
    adopt anything, and a simulation adopts only when it is the one device, so nothing is guessed.
    """
    recorded = manifest.device
    if recorded.uuid is None and recorded.index is None and gpu.source == SOURCE_SIMULATED and len(gpu.devices) == 1:
        return Placement(gpu.devices[0].index, gpu.devices[0].uuid)
    return recorded_placement(manifest)


def capped_running(known: tuple[int, str] | None, max_num_seqs: int) -> int | None:
    """An engine's running count (as `snapshot.running_counts` gives it, with its page) as rows are counted:
    never past max_num_seqs, the ceiling's row count; None where no page gives it."""
    return min(known[0], max_num_seqs) if known else None


def engine_key(manifest: Manifest) -> EngineKey:
    e = manifest.engine
    return EngineKey(e.model_name, e.stage, e.engine_index)


def first_rank(manifests: Sequence[Manifest]) -> Manifest:
    """The manifest that speaks for its engine where one value is needed (its pod): the lowest DP, PP, TP ranks."""
    return min(manifests, key=lambda m: (m.engine.data_parallel_rank, m.engine.pp_rank, m.engine.tp_rank))
