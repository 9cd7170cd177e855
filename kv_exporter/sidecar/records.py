"""A scrape's inputs as records: what `inputs` gathers and the snapshot combines (no I/O here).

And where a manifest's declarations sit: `placement` is the one rule that puts a manifest on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_exporter.gpu import SOURCE_SIMULATED, GpuMemory, GpuReadError
from kv_exporter.manifest import Manifest, ManifestError
from kv_exporter.sidecar.engine_page import EngineKey, EnginePage, EnginePageError
from kv_exporter.sidecar.liveness import State, Verdict


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
    seconds: float


@dataclass(frozen=True)
class GpuResult:
    """One pass over the GPU reader. `devices` is empty when it could not be read; `error` says why."""

    enabled: bool
    source: str | None
    devices: tuple[GpuMemory, ...] = ()
    processes: dict[int, dict[int, int]] = field(default_factory=dict)  # NVML index -> pid -> bytes
    error: GpuReadError | None = None
    device_errors: tuple[GpuReadError, ...] = ()

    @property
    def up(self) -> bool:
        return self.enabled and self.error is None


def on_device(manifest: Manifest, device: GpuMemory) -> bool:
    """A manifest's GPU by UUID when it recorded one, else by NVML index."""
    return _placed_on(manifest.device.uuid or "", manifest.device.index, device)


def _placed_on(uuid: str, index: int | None, device: GpuMemory) -> bool:
    if uuid:
        return uuid == device.uuid
    return index is not None and index == device.index


def placement(manifest: Manifest, gpu: GpuResult) -> tuple[int | None, str]:
    """(index, UUID) of the GPU a manifest's declarations sit on.

    As recorded, except that a simulated device stands in for the GPU of an engine that recorded none (a CPU
    engine in the demo or the end-to-end tests): that is what simulating a device is for. Real NVML readings never
    adopt anything, and a simulation adopts only when it is the one device, so nothing is guessed.
    """
    recorded = manifest.device
    if recorded.uuid is None and recorded.index is None and gpu.source == SOURCE_SIMULATED and len(gpu.devices) == 1:
        return gpu.devices[0].index, gpu.devices[0].uuid
    return recorded.index, recorded.uuid or ""


def engine_key(manifest: Manifest) -> EngineKey:
    e = manifest.engine
    return EngineKey(e.model_name, e.stage, e.engine_index)


def first_rank(manifests: Sequence[Manifest]) -> Manifest:
    """The manifest that speaks for its engine where one value is needed (its pod): the lowest DP, PP, TP ranks."""
    return min(manifests, key=lambda m: (m.engine.data_parallel_rank, m.engine.pp_rank, m.engine.tp_rank))
