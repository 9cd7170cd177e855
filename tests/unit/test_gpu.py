"""kv_exporter.gpu: the real binding without a GPU, and a stand-in binding raising the REAL error classes."""

from __future__ import annotations

import pynvml
import pytest

from kv_exporter.gpu import GpuReader, GpuReadError, NvmlReader, SimulatedGpu, reason_of
from tests.support.constants import GIB
from tests.support.fake_nvml import FakeBinding, FakeDevice


def two_gpus() -> list[FakeDevice]:
    return [
        FakeDevice("GPU-aaaa", "NVIDIA H100 80GB HBM3", 80 * GIB, 10 * GIB, [(101, 3 * GIB), (102, None)]),
        FakeDevice("GPU-bbbb", "NVIDIA H100 80GB HBM3", 80 * GIB, 20 * GIB),
    ]


def test_real_binding_without_gpu_reports_library_not_found() -> None:
    # This machine has no NVIDIA driver: the real pynvml must fail in nvmlInit, and we must say why.
    with pytest.raises(GpuReadError) as info:
        NvmlReader().scan()
    assert info.value.reason == "library_not_found"
    assert info.value.whole_library
    assert isinstance(info.value.__cause__, pynvml.NVMLError_LibraryNotFound)


def test_scan_reads_every_device() -> None:
    lib = FakeBinding(two_gpus())
    scan = NvmlReader(lib).scan()
    assert scan.errors == ()
    assert [(d.index, d.uuid, d.used, d.free) for d in scan.devices] == [
        (0, "GPU-aaaa", 10 * GIB, 70 * GIB),
        (1, "GPU-bbbb", 20 * GIB, 60 * GIB),
    ]
    assert scan.devices[0].name == "NVIDIA H100 80GB HBM3"
    assert lib.init_calls == 1


def test_init_is_lazy_and_once() -> None:
    lib = FakeBinding(two_gpus())
    reader = NvmlReader(lib)
    assert lib.init_calls == 0
    reader.scan()
    reader.device(1)
    reader.process_memory(0)
    assert lib.init_calls == 1
    reader.close()
    assert lib.shutdown_calls == 1


def test_lost_gpu_is_reported_and_the_others_still_read() -> None:
    devices = two_gpus()
    devices[0].error = pynvml.NVMLError_GpuIsLost
    scan = NvmlReader(FakeBinding(devices)).scan()
    assert [d.uuid for d in scan.devices] == ["GPU-bbbb"]
    assert [(e.index, e.reason, e.whole_library) for e in scan.errors] == [(0, "gpu_is_lost", False)]


def test_missing_library_is_retried_on_the_next_call() -> None:
    lib = FakeBinding(two_gpus(), init_error=pynvml.NVMLError_LibraryNotFound)
    reader = NvmlReader(lib)
    with pytest.raises(GpuReadError, match="library_not_found"):
        reader.scan()
    lib.init_error = None  # the driver appeared
    assert len(reader.scan().devices) == 2
    assert lib.init_calls == 2


def test_driver_lost_mid_run_reinitialises() -> None:
    devices = two_gpus()
    lib = FakeBinding(devices)
    reader = NvmlReader(lib)
    reader.scan()
    devices[0].error = pynvml.NVMLError_DriverNotLoaded
    with pytest.raises(GpuReadError) as info:
        reader.scan()  # a whole-library error is not hidden as one bad device
    assert info.value.reason == "driver_not_loaded"
    devices[0].error = None
    reader.scan()
    assert lib.init_calls == 2


def test_process_memory_skips_withheld_figures() -> None:
    reader = NvmlReader(FakeBinding(two_gpus()))
    assert reader.process_memory(0) == {101: 3 * GIB}
    assert reader.process_memory(1) == {}
    assert reader.device(1).uuid == "GPU-bbbb"


def test_process_memory_not_supported() -> None:
    devices = two_gpus()
    devices[1].error = pynvml.NVMLError_NotSupported
    reader = NvmlReader(FakeBinding(devices))
    with pytest.raises(GpuReadError) as info:
        reader.process_memory(1)
    assert (info.value.reason, info.value.index) == ("not_supported", 1)


def test_bad_index_is_a_typed_error() -> None:
    with pytest.raises(GpuReadError, match="invalid_argument"):
        NvmlReader(FakeBinding(two_gpus())).device(7)


def test_reason_of_plain_error_code() -> None:
    assert reason_of(pynvml.NVMLError(9999)) == "nvml_error_9999"
    assert reason_of(pynvml.NVMLError_LibRmVersionMismatch(18)) == "lib_rm_version_mismatch"


def test_simulated_device() -> None:
    gpu = SimulatedGpu(total=80 * GIB, used=30 * GIB, processes={7: GIB})
    assert gpu.source == "simulated"
    assert isinstance(gpu, GpuReader)
    (device,) = gpu.scan().devices
    assert (device.total, device.used, device.free) == (80 * GIB, 30 * GIB, 50 * GIB)
    assert gpu.process_memory(0) == {7: GIB}
    with pytest.raises(GpuReadError):
        gpu.device(1)
    with pytest.raises(ValueError):
        SimulatedGpu(total=GIB, used=2 * GIB)


def test_nvml_v2_reports_reserved_memory_apart_and_used_as_dcgm_does() -> None:
    lib = FakeBinding([FakeDevice("GPU-aaaa", "NVIDIA H200", 140 * GIB, 10 * GIB, reserved=GIB // 2)])
    [device] = NvmlReader(lib).scan().devices
    assert (device.used, device.reserved) == (10 * GIB, GIB // 2)
    assert device.free == 140 * GIB - 10 * GIB - GIB // 2
    assert device.occupied == device.used + device.reserved
    assert lib.memory_versions == [pynvml.nvmlMemory_v2]


def test_a_driver_without_the_v2_call_is_read_with_v1_and_not_asked_again() -> None:
    lib = FakeBinding(two_gpus())  # reserved None: the v2 call answers NVMLError_FunctionNotFound
    reader = NvmlReader(lib)
    first = reader.scan()
    second = reader.scan()
    assert [(d.used, d.reserved, d.occupied) for d in first.devices] == [
        (10 * GIB, None, 10 * GIB),
        (20 * GIB, None, 20 * GIB),
    ]
    assert second == first
    assert lib.memory_versions == [pynvml.nvmlMemory_v2, None, None, None, None]
