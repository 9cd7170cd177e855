"""Golden expositions: fixed manifests + the recorded real engine pages -> the exact /metrics text.

Produced by the real code path (manifest files written by the real writer, the real page served over HTTP, the
exporter scraped over HTTP). Only two things vary between runs and are normalised: the engine page's port and
the scrape duration. To regenerate after a reviewed change: KV_EXPORTER_UPDATE_GOLDEN=1 pytest tests/golden
(then read the diff: it is the public metrics API).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kv_exporter.engine_memory import EngineMemory
from kv_exporter.gpu import HOST_PID_NAMESPACE
from kv_exporter.manifest import PodInfo, manifest_filename, write_manifest
from kv_exporter.observation import CudaMemory, CudaWarm, Observation, ObservationState, OwnerObservation
from kv_exporter.reference import MIMO_AUDIO, MINICPM_O, QWEN3_TTS, ReferenceModel
from kv_exporter.sidecar.buildinfo import build_info
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from kv_exporter.steprecord import RecordWriter, new_record, record_name
from tests.support.constants import GIB, QWEN_ROW, UUID0
from tests.support.exporter import exporter, simulated_gpu
from tests.support.manifests import reference_manifest
from tests.support.net import closed_port_url
from tests.support.pages import OMNI_MODEL, OMNI_PAGE, VLLM_MODEL, VLLM_PAGE

GOLDEN = Path(__file__).resolve().parent
SIDECAR_NS = "pid:[4026532000]"  # not the manifests' namespace: liveness by the newest-incarnation rule


# What the page's engine holds: three codec caches of a whole 72-position window each (the storage a sliding layer
# really keeps, docs/cache-bytes.md), and a vocoder cache it never declared.
CODEC_OWNER = QWEN3_TTS.declarations[0][0]
WINDOW_ROW = 4_718_592


CAP = 30 * GIB
BUDGET = EngineMemory(
    kv_cache_bytes=50 * GIB, kv_cache_blocks=3200, gpu_memory_utilization=1.0, extensible_kv_cache=True
)


def observed(taken_at: float) -> Observation:
    owners = (OwnerObservation(CODEC_OWNER, 3 * WINDOW_ROW, 3), OwnerObservation("vocoder", 524_288, 1))
    # Warm-up ended at 20 GiB with one window held; since then 1 GiB more is allocated, of which the two new windows
    # and the vocoder's cache explain 9.5 MiB. The peak (23 GiB) is the profiler's, from start-up.
    warm = CudaWarm(20 * GIB, 22 * GIB, 23 * GIB, WINDOW_ROW)
    # vLLM 0.34's extensible KV cache capped the allocator at 30 GiB: 8 GiB past what it reserves now.
    cuda = CudaMemory(21 * GIB, 22 * GIB, 23 * GIB, 21 * GIB + (8 << 20), 21 * GIB, 1, 0, warm, CAP)
    return Observation(ObservationState.OK, "", 10.0, taken_at, 0.0004, owners, cuda, peaks_followed=True)


def write_inputs(folder: Path, served_model: str) -> None:
    """The fixed manifests: the page's model (Qwen3-TTS geometry, observed in a pod; its worker keeps no step
    record, so the page gives its running count), an engine no page shows (its observation off; its worker's step
    record says 5 run now, 7 at most), a restarted engine's stale leftover, a manifest from an older hook (schema
    version 1, no observation) on a GPU the reader does not have, and a broken file."""
    qwen = reference_manifest(ReferenceModel(served_model, QWEN3_TTS.declarations), pid=4242)
    pod = PodInfo(name="tts-0", namespace="serving", container="engine")
    write_manifest(folder, replace(qwen, pod=pod, observation=observed(time.time() - 1), engine_memory=BUDGET))
    off = Observation(ObservationState.OFF, "KV_EXPORTER_OBSERVE_INTERVAL=0", 0.0, 0.0, 0.0)
    mimo = write_manifest(folder, replace(reference_manifest(MIMO_AUDIO, max_num_seqs=64, pid=4300), observation=off))
    record = bytearray(new_record(4300, 1000))
    writer = RecordWriter(record)
    writer.begin(7)
    writer.end()
    writer.begin(5)  # running: the scrape comes well within a minute of it
    (folder / record_name(mimo.name)).write_bytes(bytes(record))
    current = reference_manifest(MINICPM_O, max_num_seqs=8, pid=4400, gpu=1)
    document = json.loads(current.to_json())
    del document["pod"], document["observation"], document["engine_memory"]
    path = folder / manifest_filename(current.engine)
    path.write_text(json.dumps({**document, "schema_version": 1}))
    # The same MiniCPM-o engine before its container restarted (another pid namespace, written earlier),
    # rank 1: the restarted engine has a single rank, so only a hard kill could have left this file behind.
    old = replace(
        current,
        engine=replace(current.engine, tp_rank=1),
        process=replace(current.process, pid=77, pid_namespace="pid:[4026531999]"),
        written_at=current.written_at - 3600,
    )
    write_manifest(folder, old)
    (folder / "half-written.json").write_text('{"schema_version": 1, "engine": {')


def scrape(folder: Path, page: bytes) -> str:
    gpu = simulated_gpu(processes={4242: 21 * GIB, 4300: 9 * GIB}, pid_namespace=HOST_PID_NAMESPACE)
    down = closed_port_url()
    with SimulatedEngine(page) as engine, exporter(folder, [engine.url, down], gpu, our_namespace=SIDECAR_NS) as e:
        text = e.text()
    text = text.replace(engine.url, "http://127.0.0.1:ENGINE/metrics")
    text = text.replace(down, "http://127.0.0.1:DOWN/metrics")
    text = re.sub(r"(?m)^(model_local_kv_observation_age_seconds\{.*\}) \S+$", r"\1 AGE", text)
    text = re.sub(r'pythonversion="[^"]*",revision="[^"]*"', 'pythonversion="PYTHON",revision="REVISION"', text)
    text = own_process_families_left_out(text)
    return re.sub(r"(?m)^(model_local_kv_scrape_duration_seconds) \S+$", r"\1 DURATION", text)


OWN_PROCESS = re.compile(r"^(?:# (?:HELP|TYPE) )?(process|python)_")


def own_process_families_left_out(text: str) -> str:
    """prometheus_client's process, platform and GC families: the test process's own figures, not the API's."""
    return "".join(line for line in text.splitlines(keepends=True) if not OWN_PROCESS.match(line))


def test_the_exporter_reports_its_own_process_and_build(tmp_path: Path) -> None:
    write_inputs(tmp_path, VLLM_MODEL)
    with exporter(tmp_path, [], simulated_gpu()) as e:
        text = e.text()
    for family in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds", "python_info"):
        assert re.search(rf"(?m)^{family}(\{{.*\}})? \S+$", text), family
    assert re.search(r"(?m)^python_gc_collections_total\{generation=\"0\"\} \S+$", text)
    info = build_info()
    assert (
        f'model_local_kv_exporter_build_info{{pythonversion="{info.python_version}",revision="{info.revision}",'
        f'version="{info.version}"}} 1.0'
    ) in text
    assert info.revision != "unknown"  # a checkout: read from its git metadata


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("KV_EXPORTER_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with KV_EXPORTER_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text()


@pytest.mark.parametrize(
    ("golden", "page", "model"),
    [("vllm-0.32.prom", VLLM_PAGE, VLLM_MODEL), ("vllm-omni-0.30.prom", OMNI_PAGE, OMNI_MODEL)],
)
def test_golden_exposition(tmp_path: Path, golden: str, page: Path, model: str) -> None:
    write_inputs(tmp_path, model)
    check_golden(golden, scrape(tmp_path, page.read_bytes()))


def test_golden_figures_by_hand() -> None:
    """The reviewed numbers in the vLLM golden, recomputed here from first principles."""
    text = (GOLDEN / "vllm-0.32.prom").read_text()
    # kvx-tiny runs 0 on the recorded page: two max_num_seqs-driven Qwen3-TTS entries, 256 rows still to
    # come; MiMo-Audio's worker runs 5 (its step record): 59 rows still to come, at 720,896 B; fixed rows add nothing.
    projected = 60 * GIB + 2 * 256 * QWEN_ROW + 59 * 720_896
    assert f'model_local_kv_gpu_projected_peak_bytes{{UUID="{UUID0}",gpu="0",source="simulated"}} ' in text
    value = re.search(r"model_local_kv_gpu_projected_peak_bytes\{[^}]*\} (\S+)", text)
    assert value and float(value.group(1)) == projected
    # The page's engine's workers are capped at CAP with 22 GiB reserved: their own growth (kvx-tiny's share of the
    # projection) meets the cap long before the GPU's 80 GiB, so the worker's limit binds.
    worker = CAP - 22 * GIB - (projected - 60 * GIB - 59 * 720_896)
    assert worker < 80 * GIB - projected
    for name in ("model_local_kv_gpu_headroom_bytes", "model_local_kv_worker_headroom_bytes"):
        headroom = re.search(name + r"\{[^}]*\} (\S+)", text)
        assert headroom and float(headroom.group(1)) == worker, name
    limit = re.search(r"model_local_kv_gpu_limit_bytes\{[^}]*\} (\S+)", text)
    assert limit and float(limit.group(1)) == projected + worker


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (apt-get install prometheus)")
@pytest.mark.parametrize("golden", ["vllm-0.32.prom", "vllm-omni-0.30.prom"])
def test_promtool_accepts_the_exposition(golden: str) -> None:
    text = (GOLDEN / golden).read_text().replace(" DURATION\n", " 0.01\n").replace(" AGE\n", " 1.0\n")
    command = ["promtool", "check", "metrics"]
    result = subprocess.run(command, input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
