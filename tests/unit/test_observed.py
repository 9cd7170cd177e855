"""Observed beside declared, in the sidecar: the four kinds of owner the design notes' history calls for (truthful,
under-declared, undeclared, declared and never allocating), freshness, refusals counted once, and a projected peak
that stops trusting a declaration known to be low. Real manifests through the real reader and snapshot."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from kv_exporter.gpu import GpuMemory
from kv_exporter.manifest import (
    Declaration,
    DeviceInfo,
    EngineIdentity,
    Manifest,
    Phase,
    ProcessInfo,
    manifest_filename,
    write_manifest,
)
from kv_exporter.observation import (
    CudaMemory,
    CudaUnavailable,
    CudaWarm,
    Observation,
    ObservationState,
    OwnerObservation,
    UnreadableCaches,
    UnreadableReason,
)
from kv_exporter.protocol import ModelLocalKVScope, ModelLocalKVSpec, RowDriver
from kv_exporter.sidecar.engine_page import scan_page
from kv_exporter.sidecar.families import observed_families
from kv_exporter.sidecar.inputs import ManifestStore, ObservationAccount, assess
from kv_exporter.sidecar.observed import (
    FUTURE_SKEW_S,
    FUTURE_TIMESTAMP,
    STALE_AFTER_INTERVALS,
    STALE_GRACE_S,
    ObservedState,
)
from kv_exporter.sidecar.records import GpuResult, PageResult
from kv_exporter.sidecar.snapshot import Snapshot, build_snapshot
from tests.support.constants import GIB, OTHER_NS

MODEL = "kvx-observed"
UUID = "GPU-00000000-0000-0000-0000-0000000000aa"
NOW = 1_764_480_100.0
MAX_NUM_SEQS = 8
ROW = 2 * 2 * 2 * 32 * 16 * 4  # layers x kv_heads x head_dim x positions x float32, K and V: 16,384 B
UNDECLARED = 3 * ROW


def spec(name: str, rows: RowDriver, **fixed: object) -> ModelLocalKVSpec:
    geometry = {"layers": 2, "kv_heads": 2, "head_dim": 32, "physical_capacity_positions": 16, "dtype": "float32"}
    return ModelLocalKVSpec(
        name=name,
        capacity_source="test",
        scope=ModelLocalKVScope.REQUEST,
        rows=rows,
        **geometry,
        **fixed,  # type: ignore[arg-type]
    )


DECLARATIONS = (
    Declaration.from_spec("truthful", spec("pool", RowDriver.FIXED, rows_fixed=2, rows_reason="two buckets")),
    Declaration.from_spec("under", spec("session", RowDriver.FIXED, rows_fixed=1, rows_reason="one session")),
    Declaration.from_spec("never", spec("request", RowDriver.MAX_NUM_SEQS)),
)


def held(running: int) -> tuple[OwnerObservation, ...]:
    """What the test architecture really holds: the truthful pool's two rows, a row per running sequence where one is
    declared, an undeclared cache, and nothing for the max_num_seqs-driven declaration."""
    return (
        OwnerObservation("truthful", 2 * ROW, 2),
        OwnerObservation("under", running * ROW, running),
        OwnerObservation("undeclared", UNDECLARED, 1),
    )


def observation(running: int, taken_at: float = NOW - 1, interval: float = 10.0) -> Observation:
    return Observation(ObservationState.OK, "", interval, taken_at, 0.001, held(running))


def manifest(obs: Observation | None, tp_rank: int = 0, pid: int = 4242) -> Manifest:
    return Manifest(
        engine=EngineIdentity(model_name=MODEL, tp_rank=tp_rank),
        process=ProcessInfo(pid=pid, start_time_ticks=1, pid_namespace="pid:[4026531836]", hostname="node-a"),
        device=DeviceInfo(kind="cuda", index=0, uuid=UUID),
        max_num_seqs=MAX_NUM_SEQS,
        phase=Phase.WARMUP,
        collector="kv_exporter",
        declarations=DECLARATIONS,
        written_at=NOW - 1,
        observation=obs,
    )


def page(running: int) -> PageResult:
    text = f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} {running}.0\n'
    return PageResult("http://e/metrics", scan_page(text.encode()), None, 0.0)


def device(used: int = 60 * GIB) -> GpuMemory:
    return GpuMemory(0, UUID, "test GPU", 80 * GIB, used, 80 * GIB - used)


def snapshot(manifests: list[Manifest], pages: list[PageResult], used: int = 60 * GIB) -> Snapshot:
    entries = assess([(f"/m/{i}.json", m) for i, m in enumerate(manifests)], OTHER_NS)
    return build_snapshot(entries, pages, GpuResult(True, "simulated", (device(used),)), taken_at=NOW)


def owners(snap: Snapshot) -> dict[str, tuple[int, int, int, bool]]:
    return {o.owner: (o.observed_bytes, o.unexplained_bytes, o.caches, o.declares) for o in snap.observed.owners}


def test_each_kind_of_owner_shows_what_it_holds_beside_what_it_declares() -> None:
    snap = snapshot([manifest(observation(running=5))], [page(5)])
    assert owners(snap) == {
        "truthful": (2 * ROW, 0, 2, True),  # holds its ceiling exactly
        "under": (5 * ROW, 4 * ROW, 5, True),  # declared one row, holds one per running sequence
        "undeclared": (UNDECLARED, UNDECLARED, 1, False),  # everything it holds is unexplained
        "never": (0, 0, 0, True),  # declared max_num_seqs rows and holds nothing: exported at 0
    }
    (engine,) = snap.observed.engines
    assert engine.state is ObservedState.OK and engine.age_s == 1.0


def test_the_projection_stops_trusting_a_declaration_known_to_be_low() -> None:
    used = 60 * GIB
    snap = snapshot([manifest(observation(running=5))], [page(5)], used)
    (gpu,) = snap.gpus
    to_come = MAX_NUM_SEQS - 5
    declared_growth = to_come * ROW  # the never-allocating max_num_seqs declaration: 8 rows ceiling, 5 estimated
    unexplained_growth = (math.ceil(4 * ROW / 5) + math.ceil(UNDECLARED / 5)) * to_come
    assert gpu.unexplained_growth == unexplained_growth
    assert gpu.projected_peak == used + declared_growth + unexplained_growth
    # The same declarations with nothing observed project only the declared growth: observation made it less rosy.
    blind = snapshot([manifest(None)], [page(5)], used).gpus[0]
    assert blind.projected_peak == used + declared_growth < gpu.projected_peak
    assert gpu.safe_max_num_seqs is not None and blind.safe_max_num_seqs is not None
    assert gpu.safe_max_num_seqs < blind.safe_max_num_seqs


def pool_manifest(held_rows: int) -> Manifest:
    """One owner declaring max_num_seqs rows (VibeVoice's negative pool, scope model) and holding `held_rows`."""
    pool = Declaration.from_spec("pool", spec("negative", RowDriver.MAX_NUM_SEQS))
    held = (OwnerObservation("pool", held_rows * ROW, 1),)
    obs = Observation(ObservationState.OK, "", 10.0, NOW - 1, 0.001, held)
    return dataclasses.replace(manifest(obs), declarations=(pool,))


def test_a_pool_held_in_full_is_not_projected_twice() -> None:
    """Allocated at load, the pool is in NVML's used already: its declaration's ceiling - estimate is not added."""
    used = 60 * GIB
    for running in (0, 3, MAX_NUM_SEQS):
        gpu = snapshot([pool_manifest(MAX_NUM_SEQS)], [page(running)], used).gpus[0]
        assert gpu.resident == (MAX_NUM_SEQS - running) * ROW
        assert gpu.projected_peak == used, running
        # Raising max_num_seqs needs rows beyond those held, whatever runs now.
        free_rows = (80 * GIB - used) // ROW
        assert gpu.safe_max_num_seqs == MAX_NUM_SEQS + free_rows, running
        assert gpu.unexplained_growth == 0
    # Holding nothing, or only what the running count explains, takes nothing off: the declared growth is to come.
    for held_rows, running in ((0, 3), (3, 3), (2, 3)):
        gpu = snapshot([pool_manifest(held_rows)], [page(running)], used).gpus[0]
        assert (gpu.resident, gpu.projected_peak) == (0, used + (MAX_NUM_SEQS - running) * ROW), (held_rows, running)
    # Half-way: only what is held beyond the estimate is already in used.
    gpu = snapshot([pool_manifest(5)], [page(3)], used).gpus[0]
    assert (gpu.resident, gpu.projected_peak) == (2 * ROW, used + 3 * ROW)
    assert gpu.safe_max_num_seqs == 5 + (80 * GIB - used) // ROW


def test_what_is_held_beyond_the_ceiling_is_growth_not_credit() -> None:
    """Holding more than declared: the declared growth is all in used (credit up to ceiling - estimate, no more),
    and the excess is unexplained, extrapolated as before."""
    used = 60 * GIB
    gpu = snapshot([pool_manifest(MAX_NUM_SEQS + 4)], [page(4)], used).gpus[0]
    assert gpu.resident == (MAX_NUM_SEQS - 4) * ROW
    assert gpu.unexplained_growth == math.ceil(4 * ROW / 4) * (MAX_NUM_SEQS - 4)
    assert gpu.projected_peak == used + gpu.unexplained_growth
    # An undeclared owner gets no credit: nothing was added for it to take back.
    assert snapshot([manifest(observation(running=5))], [page(5)]).gpus[0].resident == 0


def test_nothing_is_extrapolated_while_nothing_runs_or_the_engine_cannot_be_read() -> None:
    idle = snapshot([manifest(observation(running=0))], [page(0)]).gpus[0]
    unreadable = snapshot([manifest(observation(running=0))], []).gpus[0]
    assert idle.unexplained_growth == unreadable.unexplained_growth == 0


def test_workers_of_one_engine_on_one_gpu_add_up() -> None:
    workers = [manifest(observation(running=2), tp_rank=0), manifest(observation(running=2), tp_rank=1)]
    snap = snapshot(workers, [page(2)])
    assert owners(snap)["truthful"] == (4 * ROW, 0, 4, True)  # two workers' pools against two workers' ceilings
    assert owners(snap)["undeclared"][:2] == (2 * UNDECLARED, 2 * UNDECLARED)


def test_a_stale_sample_gives_no_figures_and_says_so() -> None:
    old = NOW - (STALE_AFTER_INTERVALS * 10.0 + STALE_GRACE_S) - 1
    snap = snapshot([manifest(observation(running=5, taken_at=old))], [page(5)])
    assert snap.observed.owners == ()
    (engine,) = snap.observed.engines
    assert (engine.state, engine.age_s) == (ObservedState.STALE, None)
    assert snap.gpus[0].unexplained_growth == 0


def test_the_worst_worker_state_is_the_engines() -> None:
    failing = Observation(ObservationState.FAILING, "sample raised MemoryError", 10.0, NOW - 1, 0.0)
    snap = snapshot([manifest(observation(running=1)), manifest(failing, tp_rank=1)], [page(1)])
    assert snap.observed.engines[0].state is ObservedState.FAILING
    assert {o.owner for o in snap.observed.owners} == {"truthful", "under", "undeclared", "never"}  # the ok worker's


def test_refused_observations_are_counted_once_each(tmp_path: Path) -> None:
    fresh = write_manifest(tmp_path, manifest(observation(running=1)))
    document = json.loads(fresh.read_text())
    document["observation"]["owners"][0]["bytes"] = -1
    bad = tmp_path / manifest_filename(dataclasses.replace(manifest(None).engine, tp_rank=1))
    bad.write_text(json.dumps(document))
    store, account = ManifestStore(str(tmp_path)), ObservationAccount()
    for _ in range(3):  # three scrapes of the same files
        entries = assess(store.load(), OTHER_NS)
        account.account(entries, NOW)
    assert +account.errors_total == {"out_of_range": 1}
    stale = NOW + STALE_AFTER_INTERVALS * 10.0 + STALE_GRACE_S + 1
    for _ in range(2):
        account.account(assess(store.load(), OTHER_NS), stale)
    assert +account.errors_total == {"out_of_range": 1, "stale": 1}  # once per sample, not per scrape


# -- the peak between samples, unreadable caches, and a sample dated ahead --------------------------------------


def test_unexplained_bytes_and_the_projection_use_the_peak_between_samples() -> None:
    # Between two samples the undeclared owner held 4 caches inside a step; at the sample, none (Qwen3-TTS's eager
    # decoder). The under-declared owner peaked at 6 rows while holding 5 at the sample.
    peaks = (
        OwnerObservation("truthful", 2 * ROW, 2, 2 * ROW),
        OwnerObservation("under", 5 * ROW, 5, 6 * ROW),
        OwnerObservation("undeclared", 0, 0, 4 * UNDECLARED),
    )
    obs = Observation(ObservationState.OK, "", 10.0, NOW - 1, 0.001, peaks, peaks_followed=True)
    snap = snapshot([manifest(obs)], [page(5)])
    found = {o.owner: (o.observed_bytes, o.peak_bytes, o.unexplained_bytes) for o in snap.observed.owners}
    assert found["under"] == (5 * ROW, 6 * ROW, 5 * ROW)  # max(0, peak - its one-row ceiling)
    assert found["undeclared"] == (0, 4 * UNDECLARED, 4 * UNDECLARED)  # all of its peak
    to_come = MAX_NUM_SEQS - 5
    assert snap.gpus[0].unexplained_growth == (math.ceil(5 * ROW / 5) + math.ceil(4 * UNDECLARED / 5)) * to_come


def peak_series(snap: Snapshot) -> dict[str, float]:
    family = next(f for f in observed_families(snap.observed) if f.name == "model_local_kv_observed_peak_bytes")
    return {sample.labels["owner"]: sample.value for sample in family.samples}


def test_no_peak_is_claimed_unless_every_worker_follows_it() -> None:
    followed = dataclasses.replace(observation(running=2), peaks_followed=True)
    at_sample = observation(running=2)  # KV_EXPORTER_OBSERVE_PEAK=0: the peak is the sample's figure
    assert peak_series(snapshot([manifest(followed)], [page(2)])) == {
        "truthful": 2 * ROW,
        "under": 2 * ROW,
        "undeclared": UNDECLARED,
        "never": 0,
    }
    for workers in ([manifest(at_sample)], [manifest(followed), manifest(at_sample, tp_rank=1)]):
        snap = snapshot(workers, [page(2)])
        assert peak_series(snap) == {}
        # unexplained falls back on the sample's figure: the undeclared cache is still all unexplained
        assert owners(snap)["undeclared"][1] == UNDECLARED * len(workers)


def test_unreadable_caches_are_counted_by_owner_and_reason_beside_the_figures() -> None:
    bad = (UnreadableCaches("undeclared", UnreadableReason.NO_LAYERS, 2),)
    obs = dataclasses.replace(observation(running=1), unreadable=bad)
    snap = snapshot([manifest(obs), manifest(obs, tp_rank=1)], [page(1)])
    assert [(u.owner, u.reason, u.caches) for u in snap.observed.unreadable] == [("undeclared", "no_layers", 4)]
    assert owners(snap)["undeclared"][0] == 2 * UNDECLARED  # the readable caches are still reported


def test_a_sample_dated_ahead_of_the_clock_is_rejected_and_counted_once(tmp_path: Path) -> None:
    ahead = observation(running=1, taken_at=NOW + FUTURE_SKEW_S + 1)
    within = observation(running=1, taken_at=NOW + FUTURE_SKEW_S - 1)
    assert snapshot([manifest(within)], [page(1)]).observed.engines[0].state is ObservedState.OK
    snap = snapshot([manifest(ahead)], [page(1)])
    assert snap.observed.owners == ()
    assert snap.observed.engines[0].state is ObservedState.REJECTED
    write_manifest(tmp_path, manifest(ahead))
    store, account = ManifestStore(str(tmp_path)), ObservationAccount()
    for _ in range(3):
        account.account(assess(store.load(), OTHER_NS), NOW)
    assert +account.errors_total == {FUTURE_TIMESTAMP: 1}


# -- the allocator's figures (observation.CudaMemory, schema version 4) -------------------------------------------


def family_values(snap: Snapshot, name: str) -> list[tuple[dict[str, str], float]]:
    family = next(f for f in observed_families(snap.observed) if f.name == name)
    value_name = f"{name}_total" if family.type == "counter" else name  # not a counter's _created
    return [(sample.labels, sample.value) for sample in family.samples if sample.name == value_name]


def on_cuda(obs: Observation, allocated: int, warm: CudaWarm | None, ooms: int = 0) -> Observation:
    cuda = CudaMemory(allocated, allocated + GIB, allocated + 2 * GIB, allocated + GIB, allocated, 3, ooms, warm)
    return dataclasses.replace(obs, cuda=cuda)


def test_growth_since_warm_up_that_no_observed_cache_explains_is_shown_per_engine_and_gpu() -> None:
    # At warm-up one sequence's row was held; now two run: the allocator grew by 5 GiB, the observed caches by a row.
    at_warm_up = sum(o.bytes for o in held(1))
    warm = CudaWarm(10 * GIB, 12 * GIB, 14 * GIB, at_warm_up)
    snap = snapshot([manifest(on_cuda(observation(running=2), 15 * GIB, warm))], [page(2)])
    [cuda] = snap.observed.cuda
    assert (cuda.warm_allocated_bytes, cuda.unexplained_growth_bytes) == (10 * GIB, 5 * GIB - ROW)
    [(labels, value)] = family_values(snap, "model_local_kv_observed_cuda_unexplained_growth_bytes")
    assert (labels["gpu"], labels["UUID"], value) == ("0", UUID, 5 * GIB - ROW)
    assert family_values(snap, "model_local_kv_observed_cuda_alloc_retries")[0][1] == 3
    high = family_values(snap, "model_local_kv_observed_cuda_high_water_bytes")[0][1]
    floor = family_values(snap, "model_local_kv_observed_cuda_high_water_floor_bytes")[0][1]
    assert (high, floor) == (16 * GIB, 15 * GIB)


def test_workers_add_up_and_a_worker_before_its_warm_up_end_adds_no_growth() -> None:
    warm = CudaWarm(10 * GIB, 12 * GIB, 14 * GIB, sum(o.bytes for o in held(2)))
    workers = [
        manifest(on_cuda(observation(running=2), 11 * GIB, warm, ooms=1)),
        manifest(on_cuda(observation(running=2), 7 * GIB, None), tp_rank=1),
    ]
    snap = snapshot(workers, [page(2)])
    [cuda] = snap.observed.cuda
    assert (cuda.allocated_bytes, cuda.ooms) == (18 * GIB, 1)
    assert (cuda.warm_allocated_bytes, cuda.unexplained_growth_bytes) == (10 * GIB, GIB)


def test_a_version_3_worker_exports_allocated_and_reserved_only() -> None:
    old = dataclasses.replace(manifest(on_cuda(observation(running=2), 11 * GIB, None)), schema_version=3)
    snap = snapshot([old], [page(2)])
    assert family_values(snap, "model_local_kv_observed_cuda_allocated_bytes")[0][1] == 11 * GIB
    for name in ("peak_bytes", "high_water_bytes", "ooms", "unexplained_growth_bytes"):
        assert family_values(snap, f"model_local_kv_observed_cuda_{name}") == [], name


def test_a_worker_without_allocator_figures_says_why() -> None:
    obs = dataclasses.replace(observation(running=1), cuda_unavailable=CudaUnavailable.NOT_CUDA)
    snap = snapshot([manifest(obs), manifest(obs, tp_rank=1)], [page(1)])
    [(labels, workers)] = family_values(snap, "model_local_kv_observed_cuda_unavailable")
    assert (labels["reason"], labels["model_name"], workers) == ("not_cuda", MODEL, 2)
    assert snap.observed.cuda == ()


def test_the_projection_counts_the_memory_nvml_reports_as_reserved() -> None:
    # NVML v2: used leaves the reserved memory out (as DCGM does); the projection starts from total - free.
    reserved = GpuMemory(0, UUID, "test GPU", 80 * GIB, 60 * GIB, 80 * GIB - 61 * GIB, reserved=GIB)
    entries = assess([("/m/0.json", manifest(observation(running=0)))], OTHER_NS)
    plain = build_snapshot(entries, [page(0)], GpuResult(True, "nvml", (device(60 * GIB),)), taken_at=NOW)
    v2 = build_snapshot(entries, [page(0)], GpuResult(True, "nvml", (reserved,)), taken_at=NOW)
    assert v2.gpus[0].projected_peak - plain.gpus[0].projected_peak == GIB
    assert v2.gpus[0].safe_max_num_seqs is not None and plain.gpus[0].safe_max_num_seqs is not None
    assert v2.gpus[0].safe_max_num_seqs < plain.gpus[0].safe_max_num_seqs
