"""vllm-omni 0.32.0rc1's real VibeVoice, MiniCPM-o and NemotronVoiceChat KV holders, in .venv-omni32: what each
declares (kv-exporter's collector, the published manifest) against what it really holds (its tensor storages,
counted independently, each once) and against what kv-exporter's observation sees.

Each model is built from a small random config and driven through the upstream code that allocates its KV
(kvx_omni_testplugin.real_classes, one process per model). None of the three holds its declared KV in a transformers
`Cache` alone: VibeVoice's is a raw tensor pool on the root (observation's rule 1, a declaring owner's state),
MiniCPM-o's a raw-buffer cache class held in request state (rule 2, a known class; plugin/observe/holders.py), and
NemotronVoiceChat's a transformers cache it never declares. The README's tested-with table and docs/vllm-omni.md
give the figures.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kv_exporter.gpu import GpuMemory
from kv_exporter.manifest import DeviceInfo, Manifest, read_manifest
from kv_exporter.observation import UNATTRIBUTED_OWNER, ObservationState
from kv_exporter.sidecar.liveness import State, Verdict
from kv_exporter.sidecar.observed import OwnerView
from kv_exporter.sidecar.observed import observe as sidecar_view
from kv_exporter.sidecar.records import GpuResult, ManifestEntry
from kv_exporter.sidecar.snapshot import build_snapshot
from tests.omni.omni_server import CHECKOUT_PATHS, OMNI_032

RELEASE = OMNI_032  # conftest skips these tests, with the reason, while .venv-omni32 is not built
MAX_NUM_SEQS = 4  # real_classes.MAX_NUM_SEQS
GPU_UUID = "GPU-00000000-0000-0000-0000-0000000000aa"


MODELS = ("vibevoice", "minicpmo", "nemotron")


def start(model: str, out: Path) -> subprocess.Popen[str]:
    env = {"PYTHONPATH": ":".join(map(str, CHECKOUT_PATHS)), "HOME": str(out), "VLLM_NO_USAGE_STATS": "1"}
    command = [str(RELEASE.python), "-m", "kvx_omni_testplugin.real_classes", model, str(out)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def result(proc: subprocess.Popen[str], out: Path) -> tuple[Manifest, dict[str, Any]]:
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    held: dict[str, Any] = json.loads((out / "held.json").read_text())
    return read_manifest(Path(held["manifest"])), held


def views(manifest: Manifest, path: str) -> dict[str, OwnerView]:
    """The sidecar's figures for this manifest, read as the sample was taken (it is a copy: no sampler renews it)."""
    assert manifest.observation is not None
    entry = ManifestEntry(path, manifest, Verdict(State.LIVE, "test"))
    snapshot = sidecar_view([entry], {}, GpuResult(False, None), manifest.observation.taken_at)
    return {view.owner: view for view in snapshot.owners}


def observed(manifest: Manifest) -> dict[str, tuple[int, int]]:
    assert manifest.observation is not None and manifest.observation.state is ObservationState.OK
    return {o.owner: (o.bytes, o.caches) for o in manifest.observation.owners}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Manifest, dict[str, Any]]]:
    """The three models at once, one process each (most of each one's time is importing torch and vllm-omni)."""
    outs = {model: tmp_path_factory.mktemp(model) for model in MODELS}
    procs = {model: start(model, out) for model, out in outs.items()}
    try:
        return {model: result(procs[model], outs[model]) for model in MODELS}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def peaks(manifest: Manifest) -> dict[str, int]:
    assert manifest.observation is not None and manifest.observation.peaks_followed
    return {o.owner: o.peak_bytes for o in manifest.observation.owners}


def test_vibevoice_declares_its_negative_pool_and_observation_sees_it_to_the_byte(
    measured: dict[str, tuple[Manifest, dict[str, Any]]],
) -> None:
    manifest, held = measured["vibevoice"]
    assert manifest.collector == "vllm_omni"
    [declared] = manifest.declarations
    assert (declared.owner, declared.name, declared.scope, declared.dtype) == (
        "",
        "vibevoice_negative_kv_pool",
        "model",
        "bfloat16",
    )
    # The pool is allocated in full at load: at max_num_seqs its declaration is exactly the KV tensors' storage;
    # the int32 block table beside it (one entry per 16-position page) is not declared.
    assert declared.peak_bytes(MAX_NUM_SEQS) == held["kv_pool"] > 0
    assert held["block_table"] == 4 * MAX_NUM_SEQS * (declared.physical_capacity_positions // 16)
    # allocate() itself refuses this machine's CPU (its CUDA check comes first).
    assert "requires a CUDA device" in held["cpu_allocate_refused"]
    # The root's state holds the pool (negative_kv._kv_caches): observed to the byte, one holder, and nothing else
    # the root holds (the block table, its config, the attention layers the pool keeps) is counted.
    assert observed(manifest) == {"": (held["kv_pool"], 1)}
    assert peaks(manifest) == {"": held["kv_pool"]}
    view = views(manifest, held["manifest"])[""]
    assert (view.observed_bytes, view.ceiling_bytes, view.unexplained_bytes) == (held["kv_pool"],) * 2 + (0,)
    # Nothing runs: all of it is resident beyond the estimate, so the projection does not add it again.
    assert view.resident_bytes == held["kv_pool"]


def test_vibevoice_projected_peak_holds_the_resident_pool_once(
    measured: dict[str, tuple[Manifest, dict[str, Any]]],
) -> None:
    manifest, held = measured["vibevoice"]
    on_gpu = replace(manifest, device=DeviceInfo("cuda", 0, GPU_UUID))
    used = 10 * held["kv_pool"]  # NVML's used figure holds the pool already
    device = GpuMemory(0, GPU_UUID, "test GPU", 100 * held["kv_pool"], used, 90 * held["kv_pool"])
    entries = [ManifestEntry(held["manifest"], on_gpu, Verdict(State.LIVE, "test"))]
    assert on_gpu.observation is not None
    snapshot = build_snapshot(
        entries, [], GpuResult(True, "simulated", (device,)), taken_at=on_gpu.observation.taken_at
    )
    [gpu] = snapshot.gpus
    assert (gpu.resident, gpu.projected_peak) == (held["kv_pool"], used)


def test_minicpmo_declares_one_session_at_the_position_ceiling_and_observation_sees_its_buffers(
    measured: dict[str, tuple[Manifest, dict[str, Any]]],
) -> None:
    manifest, held = measured["minicpmo"]
    [declared] = manifest.declarations
    assert (declared.owner, declared.name, declared.scope) == ("thinker.apm", "whisper_encoder_self_attn", "session")
    assert declared.row_count(MAX_NUM_SEQS) == 1 and declared.physical_capacity_positions == 1500
    # Each session's buffer grows in pages: two sessions of one page each hold what the page gives, not the ceiling.
    assert held["capacities"] == [held["page_positions"]] * held["sessions"] == [250, 250]
    per_position = declared.bytes_per_row // declared.physical_capacity_positions
    assert held["buffers"] == per_position * sum(held["capacities"])
    assert held["buffers"] < declared.peak_bytes(MAX_NUM_SEQS)
    # StreamingAudioKVCache is no transformers Cache, and the sessions live outside the module tree: each session's
    # buffer is charged to the encoder whose declaration its geometry matches, to the byte.
    assert observed(manifest) == {"thinker.apm": (held["buffers"], held["sessions"])}
    assert peaks(manifest) == {"thinker.apm": held["buffers"]}
    view = views(manifest, held["manifest"])["thinker.apm"]
    assert (view.observed_bytes, view.ceiling_bytes) == (held["buffers"], declared.peak_bytes(MAX_NUM_SEQS))
    assert view.unexplained_bytes == 0
    # Between two samples the first session grew past its page: the new buffer was allocated while the old one
    # lived, and that instant is the peak; at the sample, the two sessions' buffers as they are now.
    assert held["grown_capacity"] == 2 * held["page_positions"]
    grown = [held["grown_buffers"], held["sessions"], held["grown_instant"]]
    assert held["after_failed_capture"] == {"thinker.apm": grown}
    assert held["grown_instant"] == per_position * (held["page_positions"] * 4)
    # The CUDA-graph encoder's capture, refused here (no CUDA), stores nothing; the static KV input a capture leaves
    # ([layers, 2, 2 sessions, 250 + unit positions, embed]) is the encoder's, to the byte, and its mel and mask
    # buffers beside it are not counted.
    assert held["capture_refused"]
    now = held["grown_buffers"] + held["graph_cache"]
    assert held["later"] == {"thinker.apm": [now, held["sessions"] + 1, now]}
    assert held["graph_cache"] % (2 * per_position) == 0  # whole positions of 2 sessions


def test_nemotron_declares_nothing_and_its_transformers_cache_is_unexplained_to_the_byte(
    measured: dict[str, tuple[Manifest, dict[str, Any]]],
) -> None:
    manifest, held = measured["nemotron"]
    assert manifest.declarations == ()
    assert held["cache_class"] == "DynamicCache" and held["positions"] == 6 + 3
    # UncondStream.prefill runs outside the talker's methods here (the runtime calls it from its preprocess),
    # so the cache is the worker's, attributed to no module.
    assert observed(manifest) == {UNATTRIBUTED_OWNER: (held["cache"], 1)}
    view = views(manifest, held["manifest"])[UNATTRIBUTED_OWNER]
    assert (view.observed_bytes, view.unexplained_bytes, view.declares) == (held["cache"], held["cache"], False)
