"""NVML faults: the real library missing (this machine has no driver) against the sidecar process; a GPU lost mid-run,
the driver going away and per-process queries unsupported through a stand-in binding that raises pynvml's own error
classes, behind the real NvmlReader and the real in-process server. /metrics answers 200 throughout."""

from __future__ import annotations

from pathlib import Path

import pynvml

from kv_exporter.gpu import NvmlReader
from kv_exporter.manifest import write_manifest
from kv_exporter.reference import MIMO_AUDIO, QWEN3_TTS
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.support.constants import GIB, gpu_uuid
from tests.support.exporter import Exporter, exporter
from tests.support.fake_nvml import FakeBinding, FakeDevice
from tests.support.manifests import MODEL, live_manifest, reference_manifest
from tests.support.pages import vllm_page_with
from tests.support.scrape import Samples, absent, declared_models, pick
from tests.support.sidecar import sidecar, with_prelude

QWEN_PID, MIMO_PID = 4242, 4300  # the reference manifests' pids (host pid namespace, as NVML reports them)


def devices() -> list[FakeDevice]:
    return [
        FakeDevice(gpu_uuid(0), "NVIDIA H100 80GB HBM3", 80 * GIB, 60 * GIB, [(QWEN_PID, 21 * GIB)]),
        FakeDevice(gpu_uuid(1), "NVIDIA H100 80GB HBM3", 80 * GIB, 30 * GIB, [(MIMO_PID, 9 * GIB)]),
    ]


class NoProcessQueries(FakeBinding):
    """A device set-up where NVML withholds per-process figures (e.g. some vGPU / MIG configurations)."""

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[object]:
        self._raise(pynvml.NVMLError_NotSupported)
        raise AssertionError("unreachable")


def two_engines(folder: Path) -> Path:
    write_manifest(folder, reference_manifest(QWEN3_TTS, gpu=0, pid=QWEN_PID))
    write_manifest(folder, reference_manifest(MIMO_AUDIO, gpu=1, pid=MIMO_PID))
    return folder


def gpu_exported(s: Samples, index: int) -> bool:
    return any(n == "model_local_kv_gpu_memory_total_bytes" and ("gpu", str(index)) in ls for n, ls in s)


def test_library_missing_for_real(tmp_path: Path) -> None:
    write_manifest(tmp_path / "m", live_manifest())
    with (
        SimulatedEngine(vllm_page_with(17, MODEL)) as engine,
        sidecar(tmp_path, "--manifest-dir", str(tmp_path / "m"), "--engine-url", engine.url) as sc,
    ):
        for count in (1, 2, 3):
            s = sc.samples()
            assert pick(s, "model_local_kv_nvml_up") == 0
            assert pick(s, "model_local_kv_nvml_errors_total", reason="library_not_found") == count
            assert not gpu_exported(s, 0)
            assert declared_models(s) == {MODEL}  # everything but the GPU figures is still there
            assert pick(s, "model_local_kv_engine_up", model_name=MODEL) == 1
        assert sc.stop() == 0
    assert sc.log().count("library_not_found") == 1  # logged once, counted per scrape


def test_binding_not_installed(tmp_path: Path) -> None:
    write_manifest(tmp_path / "m", live_manifest())
    # None in sys.modules is how Python says "no such module": `import pynvml` raises ImportError.
    args = ("--manifest-dir", str(tmp_path / "m"))
    with sidecar(tmp_path, *args, entry=with_prelude("import sys; sys.modules['pynvml'] = None")) as sc:
        for count in (1, 2):
            s = sc.samples()
            assert pick(s, "model_local_kv_nvml_up") == 0
            assert pick(s, "model_local_kv_nvml_errors_total", reason="binding_missing") == count
            assert declared_models(s) == {MODEL}
        assert sc.stop() == 0


def test_gpu_lost_mid_run_then_driver_gone_then_back(tmp_path: Path) -> None:
    gpus = devices()
    lib = FakeBinding(gpus)
    with exporter(two_engines(tmp_path), [], NvmlReader(lib)) as e:
        s = e.samples()
        assert gpu_exported(s, 0) and gpu_exported(s, 1)
        assert pick(s, "model_local_kv_gpu_process_memory_bytes", gpu="1", pid=str(MIMO_PID)) == 9 * GIB

        gpus[1].error = pynvml.NVMLError_GpuIsLost
        for count in (1, 2):
            s = e.samples()
            assert pick(s, "model_local_kv_nvml_up") == 1  # the reader works; one device does not
            assert pick(s, "model_local_kv_nvml_errors_total", reason="gpu_is_lost") == count
            assert gpu_exported(s, 0) and not gpu_exported(s, 1)
            assert pick(s, "model_local_kv_gpu_projected_peak_bytes", gpu="0") > 60 * GIB
            assert declared_models(s) == {"Qwen3-TTS", "MiMo-Audio"}  # the lost GPU's declarations stay

        gpus[0].error = pynvml.NVMLError_DriverNotLoaded  # the whole driver goes away
        s = e.samples()
        assert pick(s, "model_local_kv_nvml_up") == 0
        assert pick(s, "model_local_kv_nvml_errors_total", reason="driver_not_loaded") == 1
        assert not gpu_exported(s, 0) and not gpu_exported(s, 1)

        gpus[0].error = gpus[1].error = None  # driver reloaded, GPU back
        s = e.samples()
        assert pick(s, "model_local_kv_nvml_up") == 1
        assert gpu_exported(s, 0) and gpu_exported(s, 1)
        assert lib.init_calls == 2  # re-initialised after the whole-library error


def test_per_process_query_unsupported(tmp_path: Path) -> None:
    with exporter(two_engines(tmp_path), [], NvmlReader(NoProcessQueries(devices()))) as e:
        check_process_figures_absent(e, count=1)
        check_process_figures_absent(e, count=2)


def check_process_figures_absent(e: Exporter, count: int) -> None:
    s = e.samples()
    assert pick(s, "model_local_kv_nvml_up") == 1
    assert pick(s, "model_local_kv_nvml_errors_total", reason="not_supported") == 2 * count  # both GPUs
    assert absent(s, "model_local_kv_gpu_process_memory_bytes")
    assert gpu_exported(s, 0) and gpu_exported(s, 1)  # per-GPU figures do not need per-process ones
    assert pick(s, "model_local_kv_gpu_headroom_bytes", gpu="1") < 50 * GIB
