"""A stand-in for the NVML binding (the one faked boundary): the same function names, raising pynvml's own error
classes (or hanging, as NVML can), behind the real NvmlReader."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml


@dataclass
class FakeDevice:
    uuid: str
    name: str
    total: int
    used: int
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    error: type[pynvml.NVMLError] | None = None  # raised by every per-device call
    # Kept by the driver and firmware: what NVML's version 2 memory call reports apart (None: a driver without that
    # call, which answers it with NVMLError_FunctionNotFound); version 1's used includes it.
    reserved: int | None = None


class FakeBinding:
    """Only the binding is faked: same function names, and it raises pynvml's own error classes."""

    NVMLError = pynvml.NVMLError

    def __init__(self, devices: list[FakeDevice], init_error: type[pynvml.NVMLError] | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.init_calls = 0
        self.shutdown_calls = 0
        self.memory_versions: list[int | None] = []  # each memory call's version argument

    def _raise(self, cls: type[pynvml.NVMLError]) -> None:
        # The real classes take the NVML return code; find it from the binding's own mapping.
        code = next(v for v, c in pynvml.NVMLError._valClassMapping.items() if c is cls)
        raise cls(code)

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            self._raise(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        if not 0 <= index < len(self.devices):
            self._raise(pynvml.NVMLError_InvalidArgument)
        return self.devices[index]

    def _checked(self, handle: FakeDevice) -> FakeDevice:
        if handle.error is not None:
            self._raise(handle.error)
        return handle

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        return self._checked(handle).uuid

    def nvmlDeviceGetName(self, handle: FakeDevice) -> bytes:
        return self._checked(handle).name.encode()  # older bindings return bytes

    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice, version: int | None = None) -> Any:
        self.memory_versions.append(version)
        dev = self._checked(handle)
        reserved = dev.reserved or 0
        free = dev.total - dev.used - reserved
        if version is None:
            return SimpleNamespace(total=dev.total, used=dev.used + reserved, free=free)
        if version != pynvml.nvmlMemory_v2:
            self._raise(pynvml.NVMLError_ArgumentVersionMismatch)
        if dev.reserved is None:
            self._raise(pynvml.NVMLError_FunctionNotFound)
        return SimpleNamespace(version=version, total=dev.total, reserved=dev.reserved, used=dev.used, free=free)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[Any]:
        dev = self._checked(handle)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in dev.processes]


class HangingBinding(FakeBinding):
    """NVML as a GPU that fell off the bus leaves it: memory queries block while the file `hold` exists."""

    def __init__(self, devices: list[FakeDevice], hold: Path) -> None:
        super().__init__(devices)
        self.hold = hold

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice, version: int | None = None) -> Any:
        while self.hold.exists():
            time.sleep(0.05)
        return super().nvmlDeviceGetMemoryInfo(handle, version)


def hanging_nvml(hold: Path) -> str:
    """Code for `tests.support.sidecar.with_prelude`: the sidecar's `pynvml` is one GPU behind a HangingBinding."""
    device = "FakeDevice('GPU-00000000-0000-0000-0000-000000000000', 'NVIDIA H100 80GB HBM3', 80 << 30, 60 << 30)"
    return (
        "import sys\nfrom pathlib import Path\nfrom tests.support.fake_nvml import FakeDevice, HangingBinding\n"
        f"sys.modules['pynvml'] = HangingBinding([{device}], Path({str(hold)!r}))"
    )
