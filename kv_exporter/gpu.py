"""The narrow GPU-memory interface: NVML through nvidia-ml-py, or a simulated device.

Everything else in kv-exporter sees only `GpuReader`: per-GPU total/used/free and per-process used bytes.
`NvmlReader` wraps the real binding (import name `pynvml`, from the `nvidia-ml-py` distribution; never the
deprecated `pynvml` distribution) and initialises it lazily, so importing this module never touches a driver.
`SimulatedGpu` stands in where there is no GPU (demo, tests); its `source` is "simulated" so every series it
feeds is labelled as such.

NVML reports host PIDs even inside containers (it does not know PID namespaces): per-process figures only
match a manifest's pid where the two share a PID namespace. Callers decide what to do with a missing match.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from kv_exporter.procfs import HOST_PID_NAMESPACE, current_pid_namespace

SOURCE_NVML = "nvml"
SOURCE_SIMULATED = "simulated"

# Every reason an NvmlReader can give: `reason_of` each of nvidia-ml-py's NVMLError_* classes, and the binding's
# absence (metric label values, exported at 0 before the first; tests/unit/test_reasons.py checks the binding).
# A code this list does not know (a newer driver's) is still counted, from its first occurrence.
NVML_ERROR_REASONS = (
    "binding_missing",
    "already_initialized",
    "argument_version_mismatch",
    "corrupted_inforom",
    "deprecated",
    "driver_not_loaded",
    "freq_not_supported",
    "function_not_found",
    "gpu_is_lost",
    "gpu_not_found",
    "in_use",
    "insufficient_power",
    "insufficient_resources",
    "insufficient_size",
    "invalid_argument",
    "invalid_state",
    "irq_issue",
    "lib_rm_version_mismatch",
    "library_not_found",
    "memory",
    "no_data",
    "no_permission",
    "not_found",
    "not_ready",
    "not_supported",
    "operating_system",
    "reset_required",
    "reset_type_not_supported",
    "timeout",
    "uninitialized",
    "unknown",
    "vgpu_ecc_not_supported",
)

# What NVML answers a version 2 memory call where the driver has none (then version 1 is asked).
_NO_MEMORY_V2 = frozenset({"function_not_found", "not_supported", "argument_version_mismatch"})

# Error codes meaning the library or driver as a whole is unusable (as opposed to one device failing).
_WHOLE_LIBRARY_REASONS = frozenset(
    {"library_not_found", "driver_not_loaded", "uninitialized", "lib_rm_version_mismatch", "binding_missing"}
)


@dataclass(frozen=True)
class GpuMemory:
    """One device's memory, in bytes, as NVML reports it (`index` is NVML's index, not CUDA's).

    Where NVML's version 2 memory call answers, `reserved` is what the driver and firmware keep for themselves and
    `used` leaves it out, as DCGM's FB_USED (and so dcgm-exporter) does; where only version 1 answers, `reserved` is
    None and `used` includes it. Either way `occupied` (total - free) is everything a process cannot have."""

    index: int
    uuid: str
    name: str
    total: int
    used: int
    free: int
    reserved: int | None = None

    @property
    def occupied(self) -> int:
        return self.total - self.free


class GpuReadError(Exception):
    """NVML could not answer. `reason` is a short stable code (a metric label); `index` the device, if any."""

    def __init__(self, reason: str, detail: str, index: int | None = None) -> None:
        where = "" if index is None else f"device {index}: "
        super().__init__(f"{where}{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.index = index

    @property
    def whole_library(self) -> bool:
        """True when no device can be read (library or driver missing), not just this one."""
        return self.reason in _WHOLE_LIBRARY_REASONS


@dataclass(frozen=True)
class GpuScan:
    """The devices read in one pass, and the ones that failed individually (e.g. a lost GPU)."""

    devices: tuple[GpuMemory, ...]
    errors: tuple[GpuReadError, ...] = ()


@runtime_checkable
class GpuReader(Protocol):
    """What the collector, the hook and the demo need from a GPU backend."""

    @property
    def source(self) -> str: ...

    @property
    def pid_namespace(self) -> str | None:
        """The pid namespace `process_memory`'s pids belong to (as `readlink /proc/PID/ns/pid` spells it)."""
        ...

    def scan(self) -> GpuScan:
        """All devices; raises GpuReadError only when none can be read at all."""
        ...

    def device(self, index: int) -> GpuMemory:
        """One device; raises GpuReadError."""
        ...

    def process_memory(self, index: int) -> dict[int, int]:
        """Used bytes per (host) pid on one device; pids whose figure NVML withholds are left out."""
        ...


def reason_of(exc: BaseException) -> str:
    """`NVMLError_GpuIsLost` -> "gpu_is_lost"; a plain `NVMLError` -> "nvml_error_<code>"."""
    name = type(exc).__name__
    if name.startswith("NVMLError_"):
        return re.sub(r"(?<!^)(?=[A-Z])", "_", name[len("NVMLError_") :]).lower()
    code = getattr(exc, "value", None)
    return f"nvml_error_{code}" if isinstance(code, int) else "nvml_error"


def _text(value: str | bytes) -> str:
    # Old bindings return bytes; nvidia-ml-py returns str.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _load_binding() -> ModuleType:
    import pynvml  # the nvidia-ml-py distribution

    module: ModuleType = pynvml
    return module


class NvmlReader:
    """GpuReader over the real NVML binding. `lib` is the `pynvml` module (or a stand-in with its API)."""

    source = SOURCE_NVML
    pid_namespace: str | None = HOST_PID_NAMESPACE

    def __init__(self, lib: Any | None = None) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self._initialised = False
        self._memory_v2 = True  # until the binding or driver says otherwise

    def _binding(self) -> Any:
        if self._lib is None:
            try:
                self._lib = _load_binding()
            except ImportError as exc:
                raise GpuReadError("binding_missing", f"nvidia-ml-py is not installed ({exc})") from exc
        return self._lib

    def _ready(self) -> Any:
        """The binding, initialised. Retried on every call until it works: a driver may appear later."""
        lib = self._binding()
        with self._lock:
            if not self._initialised:
                try:
                    lib.nvmlInit()
                except lib.NVMLError as exc:
                    raise GpuReadError(reason_of(exc), str(exc)) from exc
                self._initialised = True
        return lib

    def _failed(self, exc: Exception, index: int | None) -> GpuReadError:
        error = GpuReadError(reason_of(exc), str(exc), index)
        if error.whole_library:
            # The driver went away (or was never initialised): start over on the next call.
            with self._lock:
                self._initialised = False
        return error

    def device_count(self) -> int:
        lib = self._ready()
        try:
            return int(lib.nvmlDeviceGetCount())
        except lib.NVMLError as exc:
            raise self._failed(exc, None) from exc

    def device(self, index: int) -> GpuMemory:
        lib = self._ready()
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            memory = self._memory(lib, handle)
            reserved = getattr(memory, "reserved", None)
            return GpuMemory(
                index=index,
                uuid=_text(lib.nvmlDeviceGetUUID(handle)),
                name=_text(lib.nvmlDeviceGetName(handle)),
                total=int(memory.total),
                used=int(memory.used),
                free=int(memory.free),
                reserved=None if reserved is None else int(reserved),
            )
        except lib.NVMLError as exc:
            raise self._failed(exc, index) from exc

    def _memory(self, lib: Any, handle: Any) -> Any:
        """NVML's version 2 memory figures where the binding and driver have them, else version 1's (remembered:
        a driver without them answers the same way every time)."""
        version = getattr(lib, "nvmlMemory_v2", None)
        if version is not None and self._memory_v2:
            try:
                return lib.nvmlDeviceGetMemoryInfo(handle, version=version)
            except TypeError:  # a binding whose call takes no version
                self._memory_v2 = False
            except lib.NVMLError as exc:
                if reason_of(exc) not in _NO_MEMORY_V2:
                    raise
                self._memory_v2 = False
        return lib.nvmlDeviceGetMemoryInfo(handle)

    def scan(self) -> GpuScan:
        devices: list[GpuMemory] = []
        errors: list[GpuReadError] = []
        for index in range(self.device_count()):
            try:
                devices.append(self.device(index))
            except GpuReadError as exc:
                if exc.whole_library:
                    raise
                errors.append(exc)
        return GpuScan(tuple(devices), tuple(errors))

    def process_memory(self, index: int) -> dict[int, int]:
        lib = self._ready()
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            processes = lib.nvmlDeviceGetComputeRunningProcesses(handle)
        except lib.NVMLError as exc:
            raise self._failed(exc, index) from exc
        # usedGpuMemory is None where NVML withholds it (e.g. WDDM, some MIG set-ups): leave those out.
        return {int(p.pid): int(p.usedGpuMemory) for p in processes if p.usedGpuMemory is not None}

    def close(self) -> None:
        with self._lock:
            if self._initialised and self._lib is not None:
                with contextlib.suppress(self._lib.NVMLError):
                    self._lib.nvmlShutdown()
            self._initialised = False


@dataclass
class SimulatedGpu:
    """A made-up device for demos and tests: fixed total, settable used, optional per-process figures."""

    total: int
    used: int
    index: int = 0
    uuid: str = "GPU-simulated-0"
    name: str = "Simulated GPU"
    processes: Mapping[int, int] = field(default_factory=dict)
    # The simulation's pids are whatever its creator says; by default this process's namespace.
    pid_namespace: str | None = field(default_factory=current_pid_namespace)

    def __post_init__(self) -> None:
        if self.total <= 0 or not 0 <= self.used <= self.total:
            raise ValueError(f"simulated GPU: need 0 <= used ({self.used}) <= total ({self.total}) > 0")

    @property
    def source(self) -> str:
        return SOURCE_SIMULATED

    def device(self, index: int) -> GpuMemory:
        if index != self.index:
            raise GpuReadError("invalid_argument", "no such simulated device", index)
        return GpuMemory(self.index, self.uuid, self.name, self.total, self.used, self.total - self.used)

    def scan(self) -> GpuScan:
        return GpuScan((self.device(self.index),))

    def process_memory(self, index: int) -> dict[int, int]:
        self.device(index)
        return dict(self.processes)


_shared: NvmlReader | None = None
_shared_lock = threading.Lock()


def shared_reader() -> NvmlReader:
    """One NvmlReader per process (NVML initialises once; each nvmlInit would need its own nvmlShutdown)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = NvmlReader()
        return _shared
