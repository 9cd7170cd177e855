"""The limit a GPU's memory meets first, in the sidecar (sidecar/limits.py, snapshot.py, memory_families.py).

A worker whose allocator is capped (vLLM 0.34) has a limit of its own; the projection, headroom, safe max_num_seqs
and the alerts follow whichever limit is met first, tested both ways. A GPU is reported only by an exporter whose
engines use it, with their pod, and not projected while processes no manifest accounts for share it. Real manifests
through the real reader, snapshot and families; the GPU is a `GpuResult` as the reader gives it.
"""

from __future__ import annotations

import dataclasses

import pytest

from kv_exporter.engine_memory import EngineMemory
from kv_exporter.gpu import GpuMemory
from kv_exporter.manifest import (
    Declaration,
    DeviceInfo,
    EngineIdentity,
    Manifest,
    Phase,
    PodInfo,
    ProcessInfo,
)
from kv_exporter.observation import (
    AllocatorLimitAbsent,
    CudaMemory,
    CudaUnavailable,
    Observation,
    ObservationState,
    OwnerObservation,
)
from kv_exporter.protocol import ModelLocalKVScope, ModelLocalKVSpec, RowDriver
from kv_exporter.sidecar.engine_page import scan_page
from kv_exporter.sidecar.families import families
from kv_exporter.sidecar.inputs import assess
from kv_exporter.sidecar.limits import BINDING_DEVICE, BINDING_WORKER, NOT_REPORTED
from kv_exporter.sidecar.records import GpuResult, PageResult
from kv_exporter.sidecar.snapshot import Snapshot, build_snapshot
from kv_exporter.sidecar.thresholds import HeadroomState, headroom_state
from tests.support.constants import GIB, OTHER_NS

MODEL = "kvx-limits"
UUID = "GPU-00000000-0000-0000-0000-0000000000bb"
NOW = 1_764_480_100.0
MAX_NUM_SEQS = 64
ROW = 64 << 20  # a 64 MiB row per running sequence
POD = PodInfo(name="tts-0", namespace="serving", container="engine")
HOST_NS = "pid:[4026531836]"

DECLARATION = Declaration.from_spec(
    "codec",
    ModelLocalKVSpec(
        name="request",
        layers=4,
        kv_heads=8,
        head_dim=128,
        dtype="float32",
        physical_capacity_positions=ROW // (2 * 4 * 8 * 128 * 4),
        capacity_source="test",
        scope=ModelLocalKVScope.REQUEST,
        rows=RowDriver.MAX_NUM_SEQS,
    ),
)
assert DECLARATION.bytes_per_row == ROW


def observation(cuda: CudaMemory | None, unavailable: CudaUnavailable | None = None, running: int = 4) -> Observation:
    owners = (OwnerObservation("codec", running * ROW, running),)
    return Observation(ObservationState.OK, "", 10.0, NOW - 1, 0.001, owners, cuda, cuda_unavailable=unavailable)


def capped(limit: int, reserved: int = 20 * GIB) -> CudaMemory:
    return CudaMemory(allocated_bytes=reserved - GIB, reserved_bytes=reserved, limit_bytes=limit)


def manifest(obs: Observation | None, pid: int = 4242, pod: PodInfo = POD, engine: int = 0) -> Manifest:
    return Manifest(
        engine=EngineIdentity(model_name=MODEL, engine_index=engine),
        process=ProcessInfo(pid=pid, start_time_ticks=1, pid_namespace=HOST_NS, hostname="node-a"),
        device=DeviceInfo(kind="cuda", index=0, uuid=UUID),
        max_num_seqs=MAX_NUM_SEQS,
        phase=Phase.WARMUP,
        collector="kv_exporter",
        declarations=(DECLARATION,),
        written_at=NOW - 1,
        observation=obs,
        pod=pod,
    )


def page(running: int = 4, engines: int = 1) -> PageResult:
    text = "".join(
        f'vllm:num_requests_running{{engine="{e}",model_name="{MODEL}"}} {running}.0\n' for e in range(engines)
    )
    return PageResult("http://e/metrics", scan_page(text.encode()), None, 0.0)


def snapshot(
    manifests: list[Manifest],
    used: int = 40 * GIB,
    processes: dict[int, int] | None = None,
    comparable: bool = True,
    engines: int = 1,
) -> Snapshot:
    entries = assess([(f"/m/{i}.json", m) for i, m in enumerate(manifests)], OTHER_NS)
    gpu = GpuMemory(0, UUID, "test GPU", 80 * GIB, used, 80 * GIB - used)
    listed = {0: processes if processes is not None else {m.process.pid: GIB for m in manifests}}
    result = GpuResult(True, "nvml", (gpu,), listed, frozenset({0}) if comparable else frozenset())
    return build_snapshot(entries, [page(engines=engines)], result, taken_at=NOW)


GROWTH = (MAX_NUM_SEQS - 4) * ROW  # 60 rows still to come: 3.75 GiB


def test_a_roomy_cap_leaves_the_device_binding() -> None:
    snap = snapshot([manifest(observation(capped(limit=70 * GIB)))])
    (gpu,) = snap.gpus
    (worker,) = snap.limits.workers
    assert worker.headroom_bytes == 70 * GIB - 20 * GIB - GROWTH
    assert gpu.binding == BINDING_DEVICE
    assert gpu.headroom == 80 * GIB - (40 * GIB + GROWTH) < worker.headroom_bytes
    assert gpu.limit == 80 * GIB
    assert gpu.safe_max_num_seqs == 4 + (40 * GIB) // ROW  # the device's: 640 more rows fit in 40 GiB


def test_a_tight_cap_binds_while_the_device_has_room() -> None:
    """vLLM 0.34's case: the cap leaves 2 GiB past what the worker reserves; its growth needs 3.75 GiB. NVML shows
    40 GiB free, and still a model-local allocation will fail: the projection says so."""
    snap = snapshot([manifest(observation(capped(limit=22 * GIB)))])
    (gpu,) = snap.gpus
    assert gpu.binding == BINDING_WORKER
    assert gpu.headroom == 2 * GIB - GROWTH < 0 < 80 * GIB - gpu.projected_peak
    assert gpu.limit == gpu.projected_peak + gpu.headroom
    assert gpu.safe_max_num_seqs == 4 + (2 * GIB) // ROW  # 32 more rows fit under the cap, not 640
    assert headroom_state(gpu.headroom, gpu.declared_ceiling) is HeadroomState.OVER


def test_the_warning_margin_is_a_share_of_the_declared_ceiling() -> None:
    ceiling = MAX_NUM_SEQS * ROW  # 4 GiB: the margin is 5 % of it, 204.8 MiB
    fits_closely = snapshot([manifest(observation(capped(limit=20 * GIB + GROWTH + 100 * (1 << 20))))])
    assert fits_closely.gpus[0].headroom == 100 * (1 << 20)
    assert headroom_state(fits_closely.gpus[0].headroom, ceiling) is HeadroomState.LOW
    fits = snapshot([manifest(observation(capped(limit=20 * GIB + GROWTH + GIB)))])
    assert headroom_state(fits.gpus[0].headroom, ceiling) is HeadroomState.OK
    assert fits.gpus[0].declared_ceiling == ceiling


def families_of(snap: Snapshot) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in families(snap)}


def test_worker_figures_carry_the_engine_gpu_and_pod() -> None:
    found = families_of(snapshot([manifest(observation(capped(limit=22 * GIB)))]))
    ((labels, limit),) = found["model_local_kv_worker_allocator_limit_bytes"]
    assert limit == 22 * GIB
    assert labels == {
        "model_name": MODEL,
        "stage": "0",
        "engine": "0",
        "gpu": "0",
        "UUID": UUID,
        "pod": "tts-0",
        "namespace": "serving",
        "container": "engine",
    }
    ((_, headroom),) = found["model_local_kv_worker_headroom_bytes"]
    assert headroom == 2 * GIB - GROWTH
    binding = {s["limit"]: v for s, v in found["model_local_kv_gpu_limit_binding"]}
    assert binding == {"device": 0, "worker": 1}
    assert found["model_local_kv_worker_allocator_limit_absent"] == []


@pytest.mark.parametrize(
    ("obs", "reason"),
    [
        (observation(CudaMemory(GIB, GIB, limit_absent=AllocatorLimitAbsent.NO_CAP)), "no_cap"),
        (observation(CudaMemory(GIB, GIB)), NOT_REPORTED),  # as a version 4 worker's figures read
        (observation(None, CudaUnavailable.NOT_CUDA), "not_cuda"),
        (observation(None), NOT_REPORTED),
    ],
)
def test_a_worker_without_a_cap_says_why_and_the_device_binds(obs: Observation, reason: str) -> None:
    snap = snapshot([manifest(obs)])
    found = families_of(snap)
    assert found["model_local_kv_worker_allocator_limit_bytes"] == []
    ((labels, workers),) = found["model_local_kv_worker_allocator_limit_absent"]
    assert (labels["reason"], workers) == (reason, 1)
    assert snap.gpus[0].binding == BINDING_DEVICE and snap.gpus[0].limit == 80 * GIB


def test_the_gpu_carries_its_pod_and_no_pod_where_several_share_it() -> None:
    mine = families_of(snapshot([manifest(observation(capped(60 * GIB)))]))
    ((labels, _),) = mine["model_local_kv_gpu_memory_total_bytes"]
    assert (labels["pod"], labels["namespace"], labels["container"]) == ("tts-0", "serving", "engine")
    other_pod = manifest(observation(capped(60 * GIB)), pid=4343, pod=PodInfo(name="tts-1", namespace="serving"))
    node = families_of(snapshot([manifest(observation(capped(60 * GIB))), dataclasses.replace(other_pod)]))
    ((labels, _),) = node["model_local_kv_gpu_memory_total_bytes"]  # one series for the GPU, whoever runs on it
    assert "pod" not in labels


def test_another_pods_process_on_the_gpu_withholds_the_projection() -> None:
    """A sidecar cannot see another pod's engine grow: it says so and does not project its GPU."""
    shared = snapshot([manifest(observation(capped(60 * GIB)))], processes={4242: 20 * GIB, 5555: 10 * GIB})
    found = families_of(shared)
    ((labels, others),) = found["model_local_kv_gpu_other_processes"]
    assert others == 1 and labels["pod"] == "tts-0"
    for name in ("model_local_kv_gpu_memory_total_bytes", "model_local_kv_gpu_projected_peak_bytes"):
        assert found[name] == [], name
    assert found["model_local_kv_gpu_headroom_bytes"] == []
    assert found["model_local_kv_worker_headroom_bytes"] != []  # its own cap is its own: still there
    alone = families_of(snapshot([manifest(observation(capped(60 * GIB)))], processes={4242: 20 * GIB}))
    assert [v for _, v in alone["model_local_kv_gpu_other_processes"]] == [0]
    assert alone["model_local_kv_gpu_projected_peak_bytes"] != []


def test_without_comparable_pids_processes_are_counted() -> None:
    """NVML lists host pids; a sidecar's manifests record its pod's: two NVML processes for one worker is one other."""
    two = snapshot([manifest(observation(capped(60 * GIB)))], processes={91: GIB, 92: GIB}, comparable=False)
    assert two.gpus[0].other_processes == 1 and not two.gpus[0].projected
    one = snapshot([manifest(observation(capped(60 * GIB)))], processes={91: GIB}, comparable=False)
    assert one.gpus[0].other_processes == 0 and one.gpus[0].projected
    assert one.gpus[0].processes == {}  # pid 91 is not the manifest's 4242 in any namespace it can tell


def test_two_capped_engines_on_one_gpu_each_meet_their_own_cap() -> None:
    roomy = manifest(observation(capped(60 * GIB)), pid=1, engine=0)
    tight = manifest(observation(capped(22 * GIB)), pid=2, engine=1)
    snap = snapshot([roomy, tight], engines=2)
    headrooms = {w.key.engine: w.headroom_bytes for w in snap.limits.workers}
    assert headrooms == {0: 40 * GIB - GROWTH, 1: 2 * GIB - GROWTH}
    assert snap.gpus[0].binding == BINDING_WORKER and snap.gpus[0].headroom == 2 * GIB - GROWTH


def test_the_engine_s_own_budget_is_exported_beside() -> None:
    budget = EngineMemory(
        kv_cache_bytes=50 * GIB, kv_cache_blocks=3200, gpu_memory_utilization=1.0, extensible_kv_cache=True
    )
    found = families_of(snapshot([dataclasses.replace(manifest(observation(capped(60 * GIB))), engine_memory=budget)]))
    figures = {
        name: [v for _, v in found[f"model_local_kv_engine_{name}"]]
        for name in ("kv_cache_bytes", "kv_cache_blocks", "gpu_memory_utilization", "extensible_kv_cache")
    }
    assert figures == {
        "kv_cache_bytes": [50 * GIB],
        "kv_cache_blocks": [3200],
        "gpu_memory_utilization": [1.0],
        "extensible_kv_cache": [1],
    }
