"""kv_exporter.sidecar.collection: the arithmetic, the fallbacks and the manifest cache, from real manifests."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_exporter.gpu import GpuMemory
from kv_exporter.manifest import Manifest, write_manifest
from kv_exporter.reference import MIMO_AUDIO, MINICPM_O, QWEN3_TTS, ReferenceModel
from kv_exporter.sidecar.budget import SeriesCap, manifest_cost
from kv_exporter.sidecar.collection import (
    Collection,
    CollectionSettings,
    FlightTimeout,
    SingleFlight,
)
from kv_exporter.sidecar.engine_page import EngineTarget, scan_page
from kv_exporter.sidecar.families import families
from kv_exporter.sidecar.inputs import ManifestStore, assess
from kv_exporter.sidecar.liveness import State
from kv_exporter.sidecar.records import FolderState, GpuResult, ManifestEntry, PageResult
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from kv_exporter.sidecar.snapshot import DeclarationView, Snapshot, build_snapshot, safe_max_num_seqs
from tests.support.constants import GIB, OTHER_NS, QWEN_ROW, UUID0
from tests.support.exporter import simulated_gpu
from tests.support.manifests import reference_manifest
from tests.support.pages import vllm_page_with


def gpu0(used: int = 60 * GIB, total: int = 80 * GIB) -> GpuMemory:
    return GpuMemory(0, UUID0, "test GPU", total, used, total - used)


def entries_for(*manifests: Manifest) -> list[ManifestEntry]:
    return assess([(f"/m/{i}.json", m) for i, m in enumerate(manifests)], OTHER_NS)


def page(model: str, running: int, target: str = "http://e/metrics") -> PageResult:
    return PageResult(target, scan_page(vllm_page_with(running, model)), None, 0.0)


def snapshot(manifests: list[Manifest], pages: list[PageResult], device: GpuMemory | None = None) -> Snapshot:
    devices = (device or gpu0(),)
    return build_snapshot(entries_for(*manifests), pages, GpuResult(True, "simulated", devices))


def by_cache(snap: Snapshot, name: str) -> DeclarationView:
    (view,) = [v for v in snap.declarations if v.declaration.name == name]
    return view


def test_qwen3_tts_at_256_with_17_running() -> None:
    used = 60 * GIB
    snap = snapshot([reference_manifest(QWEN3_TTS, max_num_seqs=256)], [page("Qwen3-TTS", 17)], gpu0(used))
    entry = by_cache(snap, "codec_decoder_request_cache")
    assert entry.ceiling_bytes == 256 * QWEN_ROW
    assert entry.estimate_rows == 17
    assert entry.estimate_bytes == 17 * QWEN_ROW
    graph_pool = by_cache(snap, "codec_decoder_graph_pool")
    assert graph_pool.ceiling_bytes == graph_pool.estimate_bytes == 31 * QWEN_ROW
    (gpu,) = snap.gpus
    # Two max_num_seqs-driven entries (request cache, working copy), each 256 - 17 rows still to come.
    assert gpu.projected_peak == used + 2 * (256 - 17) * QWEN_ROW
    assert gpu.projected_peak == used + sum(v.ceiling_bytes - v.estimate_bytes for v in snap.declarations)
    assert gpu.headroom == 80 * GIB - gpu.projected_peak


def test_running_above_max_num_seqs_is_capped() -> None:
    snap = snapshot([reference_manifest(QWEN3_TTS, max_num_seqs=8)], [page("Qwen3-TTS", 30)])
    assert by_cache(snap, "codec_decoder_request_cache").estimate_rows == 8
    assert snap.gpus[0].projected_peak == snap.gpus[0].memory.used


def test_engine_unreadable_falls_back_to_zero_rows() -> None:
    down = PageResult("http://e/metrics", None, None, 0.0)
    snap = snapshot([reference_manifest(QWEN3_TTS, max_num_seqs=256)], [down])
    entry = by_cache(snap, "codec_decoder_request_cache")
    assert (entry.estimate_rows, entry.running) == (0, None)
    assert by_cache(snap, "codec_decoder_graph_pool").estimate_rows == 31  # fixed rows do not depend on it
    (engine,) = snap.engines
    assert (engine.up, engine.running, engine.max_num_seqs, engine.manifests) == (False, None, 256, 1)
    assert snap.gpus[0].projected_peak == snap.gpus[0].memory.used + 2 * 256 * QWEN_ROW


def test_engine_on_a_page_without_manifests() -> None:
    snap = snapshot([], [page("unknown-model", 3)])
    (engine,) = snap.engines
    assert (engine.key.model_name, engine.up, engine.running) == ("unknown-model", True, 3)
    assert engine.manifests == 0
    assert engine.max_num_seqs is None


def test_a_gpu_no_engine_of_this_exporter_uses_is_not_reported() -> None:
    """GPU 0 is read, but the only manifest sits on GPU 1: GPU 0 is another exporter's (or nobody's) to report."""
    other = reference_manifest(QWEN3_TTS, gpu=1)
    snap = snapshot([other], [page("Qwen3-TTS", 0)])
    assert snap.gpus == ()
    assert len(snap.declarations) == 3  # still exported per declaration
    mine = snapshot([reference_manifest(QWEN3_TTS), other], [page("Qwen3-TTS", 0)])
    (gpu,) = mine.gpus
    assert gpu.memory.index == 0 and gpu.declarations == 3


def test_stale_manifest_is_excluded() -> None:
    # The same engine before and after its container restarted (a new pid namespace), plus another engine.
    before = reference_manifest(QWEN3_TTS, pid=100)
    before = replace(before, process=replace(before.process, pid_namespace="pid:[111]"), written_at=1000.0)
    after = replace(before, process=replace(before.process, pid_namespace="pid:[222]"), written_at=2000.0)
    other = reference_manifest(MIMO_AUDIO, pid=200)
    snap = snapshot([before, after, other], [page("Qwen3-TTS", 0)])
    states = [e.verdict.state for e in snap.manifests]
    assert states == [State.STALE, State.LIVE, State.LIVE]
    assert snap.manifest_counts() == {State.LIVE: 2, State.STALE: 1, State.INVALID: 0}
    qwen = [v for v in snap.declarations if v.model_name == "Qwen3-TTS"]
    assert len(qwen) == 3  # the restarted engine's declarations, once
    (engine,) = [e for e in snap.engines if e.key.model_name == "Qwen3-TTS"]
    assert engine.manifests == 1
    assert snap.gpus[0].projected_peak == snap.gpus[0].memory.used + 2 * 256 * QWEN_ROW + 256 * 720_896


def omni_estimate_rows(page_file: Path, model_name: str) -> int:
    model = ReferenceModel(model_name, MIMO_AUDIO.declarations)
    result = PageResult("http://omni/metrics", scan_page(page_file.read_bytes()), None, 0.0)
    snap = snapshot([reference_manifest(model, max_num_seqs=64)], [result])
    return by_cache(snap, "local_transformer_cache").estimate_rows


def test_omni_stage_count_under_load_and_zero_once_the_pipeline_is_idle() -> None:
    tests = Path(__file__).parent.parent
    # Recorded with 8 in flight: the stage says 8, the lagging pipeline gauge 1 (busy, so the stage count stands).
    assert omni_estimate_rows(tests / "fixtures" / "vllm-omni-0.30-metrics.txt", "/tmp/tinyq") == 8
    # Recorded after the load: the stage stayed at a stale 8, the pipeline went back to 0.
    assert omni_estimate_rows(tests / "omni" / "pages" / "vllm-omni-0.30-metrics-after-load.txt", "/tmp/tinyq") == 0


def test_first_page_wins_a_duplicate_engine() -> None:
    snap = snapshot([reference_manifest(QWEN3_TTS)], [page("Qwen3-TTS", 5, "a"), page("Qwen3-TTS", 9, "b")])
    (engine,) = snap.engines
    assert (engine.running, engine.target) == (5, "a")


def test_duplicate_label_sets_add_up() -> None:
    # Two tensor-parallel ranks of one engine on the same GPU: their bytes add up under one series.
    a = reference_manifest(MINICPM_O, pid=1)
    b = replace(a, engine=replace(a.engine, tp_rank=1))
    snap = snapshot([a, b], [page("MiniCPM-o", 0)])
    ceiling = next(f for f in families(snap) if f.name == "model_local_kv_ceiling_bytes")
    (sample,) = ceiling.samples
    assert sample.value == 2 * 147_456_000


def brute_force_safe(device: GpuMemory, rows: list[tuple[int, int]]) -> int:
    m = 0
    while device.used + sum(b * max(0, m + 1 - e) for b, e in rows) <= device.total:
        m += 1
    return m


@given(
    used=st.integers(0, 10_000),
    free=st.integers(0, 10_000),
    rows=st.lists(st.tuples(st.integers(1, 500), st.integers(0, 40)), min_size=1, max_size=4),
)
def test_safe_max_num_seqs_matches_brute_force(used: int, free: int, rows: list[tuple[int, int]]) -> None:
    device = GpuMemory(0, UUID0, "x", used + free, used, free)
    views = []
    for per_row, estimate in rows:
        view = by_cache(snapshot([reference_manifest(QWEN3_TTS)], []), "codec_decoder_request_cache")
        # one byte-wide element, K and V: 2 * per_row bytes a row
        decl = replace(
            view.declaration, dtype="uint8", layers=1, kv_heads=1, head_dim=1, physical_capacity_positions=per_row
        )
        views.append(replace(view, placed=replace(view.placed, declaration=decl), estimate_rows=estimate))
    assert safe_max_num_seqs(device.free, views) == brute_force_safe(device, [(2 * b, e) for b, e in rows])


def test_safe_max_num_seqs_for_qwen_example() -> None:
    used, total = 60 * GIB, 80 * GIB
    manifest = reference_manifest(QWEN3_TTS, max_num_seqs=256)
    snap = snapshot([manifest], [page("Qwen3-TTS", 17)], gpu0(used, total))
    safe = snap.gpus[0].safe_max_num_seqs
    assert safe is not None
    fits = used + 2 * QWEN_ROW * (safe - 17)
    assert fits <= total < fits + 2 * QWEN_ROW


# -- the manifest store -------------------------------------------------------------------------------------


def test_store_parses_each_version_once_and_counts_errors_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = write_manifest(tmp_path, reference_manifest(QWEN3_TTS))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    (tmp_path / ".tmp-x.part").write_text("ignored")
    store = ManifestStore(str(tmp_path))
    for _ in range(3):
        loaded = dict(store.load())
    assert isinstance(loaded[str(good)], Manifest)
    assert +store.errors_total == {"invalid_json": 1}
    assert sum("invalid manifest" in r.message for r in caplog.records) == 1
    first = loaded[str(good)]
    assert dict(store.load())[str(good)] is first  # cached, not re-parsed
    bad.write_text(json.dumps({"schema_version": 99}))
    store.load()
    store.load()
    assert +store.errors_total == {"invalid_json": 1, "unsupported_schema_version": 1}
    bad.unlink()
    assert [p for p, _ in store.load()] == [str(good)]


def test_store_rereads_a_rewritten_manifest(tmp_path: Path) -> None:
    write_manifest(tmp_path, reference_manifest(QWEN3_TTS, max_num_seqs=8))
    store = ManifestStore(str(tmp_path))
    ((_, first),) = store.load()
    write_manifest(tmp_path, reference_manifest(QWEN3_TTS, max_num_seqs=16))
    ((_, second),) = store.load()
    assert isinstance(first, Manifest) and isinstance(second, Manifest)
    assert (first.max_num_seqs, second.max_num_seqs) == (8, 16)


def test_store_missing_folder(tmp_path: Path) -> None:
    store = ManifestStore(str(tmp_path / "nope"))
    assert store.load() == []
    store.load()
    assert store.folder_error is not None
    assert +store.errors_total == {"folder_unreadable": 1}


def _file(path: Path) -> Path:
    path.write_text("not a folder\n")
    return path


def _under_a_file(path: Path) -> Path:
    return _file(path) / "m"


def _dangling_link(path: Path) -> Path:
    path.symlink_to(path.parent / "gone")
    return path


@pytest.mark.parametrize(
    ("make", "state"),
    [
        (lambda p: p, FolderState.MISSING),
        (_dangling_link, FolderState.MISSING),
        (_under_a_file, FolderState.MISSING),
        (_file, FolderState.NOT_A_FOLDER),
        (lambda p: p.mkdir() or p, FolderState.OK),
    ],
    ids=["missing", "dangling-link", "under-a-file", "a-file", "ok"],
)
def test_store_says_what_the_folder_is_and_the_page_shows_it(
    tmp_path: Path, make: Callable[[Path], Path], state: FolderState
) -> None:
    """A wrong --manifest-dir, the classic set-up mistake, is one gauge with a series per state (1 for the folder's),
    for as long as it lasts: the error counter alone counted it once. (Unreadable needs permission bits that root
    ignores: tests/reliability/test_manifest_faults.py runs it against the real sidecar.)"""
    store = ManifestStore(str(make(tmp_path / "m")))
    store.load()
    assert store.folder_state is state
    snap = build_snapshot([], [], GpuResult(False, None), manifest_folder_state=store.folder_state)
    (gauge,) = [f for f in families(snap) if f.name == "model_local_kv_manifest_folder_state"]
    assert {s.labels["state"]: s.value for s in gauge.samples} == {f.value: int(f is state) for f in FolderState}


# -- single flight ------------------------------------------------------------------------------------------


def test_single_flight_shares_one_call() -> None:
    calls = []
    gate = threading.Event()

    def slow() -> int:
        calls.append(1)
        gate.wait(5)
        return len(calls)

    flight = SingleFlight(slow)
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(flight())) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join(5)
    assert results == [1] * 8
    assert flight() == 2  # a later call collects afresh


def test_single_flight_propagates_errors_and_recovers() -> None:
    outcomes: Iterator[Exception | int] = iter([ValueError("boom"), 7])

    def fn() -> int:
        item = next(outcomes)
        if isinstance(item, Exception):
            raise item
        return item

    flight = SingleFlight(fn)
    with pytest.raises(ValueError):
        flight()
    assert flight() == 7


def test_a_stuck_call_holds_its_first_caller_only_and_is_never_run_twice() -> None:
    calls: list[int] = []
    release = threading.Event()

    def stuck() -> int:
        calls.append(threading.get_ident())
        release.wait(30)  # a read that does not return
        return len(calls)

    flight = SingleFlight(stuck, deadline_s=0.3)
    first: list[int] = []
    leader = threading.Thread(target=lambda: first.append(flight()))
    started = time.monotonic()
    leader.start()
    while not calls:
        time.sleep(0.001)
    assert calls == [leader.ident]  # run by the caller that started it, not handed to another thread
    with pytest.raises(FlightTimeout, match=r"past its 0\.3 s deadline"):
        flight()  # a caller that joins gives up at the deadline
    assert 0.25 < time.monotonic() - started < 2
    assert flight.running_for() >= 0.3 and leader.is_alive()
    quick = time.monotonic()
    with pytest.raises(FlightTimeout):
        flight()  # a later caller joins the stuck call, past its deadline already
    assert time.monotonic() - quick < 0.2
    assert len(calls) == 1
    release.set()
    leader.join(5)
    assert first == [1] and flight.running_for() == 0
    assert flight() == 2  # back to normal once it returned


def test_collection_end_to_end(tmp_path: Path) -> None:
    write_manifest(tmp_path, reference_manifest(QWEN3_TTS, max_num_seqs=256))
    gpu = simulated_gpu()
    with SimulatedEngine(vllm_page_with(17, "Qwen3-TTS")) as engine:
        settings = CollectionSettings(str(tmp_path), (EngineTarget.parse(engine.url),))
        collection = Collection(settings, gpu, our_namespace=OTHER_NS)
        try:
            snap = collection.snapshot()
        finally:
            collection.close()
    assert by_cache(snap, "codec_decoder_request_cache").estimate_rows == 17
    assert snap.gpus[0].projected_peak == 60 * GIB + 2 * 239 * QWEN_ROW
    assert snap.duration_s > 0
    assert os.path.isdir(tmp_path)


def test_every_family_is_documented_and_in_the_contract() -> None:
    docs = (Path(__file__).resolve().parent.parent.parent / "docs").resolve()
    snap = snapshot([reference_manifest(QWEN3_TTS)], [page("Qwen3-TTS", 1)])
    names = {f.name + ("_total" if f.type == "counter" else "") for f in families(snap)}
    assert len(names) == 63
    for doc in ("metrics.md", "CONTRACTS.md"):
        text = (docs / doc).read_text()
        missing = {n for n in names if f"`{n}" not in text}
        assert not missing, (doc, missing)


def test_series_cap_leaves_series_out_but_not_the_projection() -> None:
    manifests = [reference_manifest(QWEN3_TTS, max_num_seqs=256), reference_manifest(MINICPM_O)]
    entries = entries_for(*manifests)
    gpu = GpuResult(True, "simulated", (gpu0(),))
    pages = [page("Qwen3-TTS", 17), page("MiniCPM-o", 0)]
    full = build_snapshot(entries, pages, gpu)
    capped = build_snapshot(entries, pages, gpu, cap=SeriesCap(manifest_cost(manifests[0]).series))
    assert len(capped.series_dropped) == 1
    assert len(capped.declarations) < len(full.declarations)
    assert capped.gpus[0].projected_peak == full.gpus[0].projected_peak
    assert capped.gpus[0].safe_max_num_seqs == full.gpus[0].safe_max_num_seqs


def test_page_error_series_follow_the_configured_targets_and_sort_reasons_within_each() -> None:
    # Ports differ from one start to the next: sorted by URL, the targets' order on the page would too.
    later, first = "http://127.0.0.1:9/metrics", "http://127.0.0.1:10000/metrics"
    counts = {(later, "timeout"): 0, (later, "malformed"): 2, (first, "unreachable"): 1, (first, "bad_value"): 0}
    snapshot = build_snapshot([], [], GpuResult(True, "simulated", []), page_errors_total=counts)
    [family] = [f for f in families(snapshot) if f.name == "model_local_kv_engine_page_errors"]
    order = [(s.labels["target"], s.labels["reason"], s.value) for s in family.samples]
    assert order == [(later, "malformed", 2), (later, "timeout", 0), (first, "bad_value", 0), (first, "unreachable", 1)]


def claiming(running: str, model: str) -> bytes:
    """The recorded vLLM page, its running count written as `running` (any number Prometheus takes)."""
    honest = vllm_page_with(1, model)
    return honest.replace(f'model_name="{model}"}} 1.0'.encode(), f'model_name="{model}"}} {running}'.encode())


def scrape_twice(folder: Path, page_bytes: bytes) -> tuple[Snapshot, Snapshot]:
    gpu = simulated_gpu()
    with SimulatedEngine(page_bytes) as engine:
        collection = Collection(CollectionSettings(str(folder), (EngineTarget.parse(engine.url),)), gpu, OTHER_NS)
        try:
            return collection.snapshot(), collection.snapshot()
        finally:
            collection.close()


@pytest.mark.parametrize("claim", ["9", "65", "1e6", "1e308"])
def test_a_running_count_above_the_engines_max_num_seqs_is_refused_and_counted(tmp_path: Path, claim: str) -> None:
    write_manifest(tmp_path, reference_manifest(QWEN3_TTS, max_num_seqs=8))
    first, second = scrape_twice(tmp_path, claiming(claim, "Qwen3-TTS"))
    (engine,) = second.engines
    assert (engine.up, engine.running) == (False, None)  # read as an unreadable engine: 0 rows, an upper bound
    target = engine_target(second)
    assert [s.page_errors_total[(target, "running_above_max_num_seqs")] for s in (first, second)] == [1, 2]
    _, honest = scrape_twice(tmp_path, claiming("8", "Qwen3-TTS"))  # a full engine, honestly
    assert second.gpus[0].projected_peak >= honest.gpus[0].projected_peak
    assert honest.page_errors_total[(engine_target(honest), "running_above_max_num_seqs")] == 0


def engine_target(snap: Snapshot) -> str:
    (result,) = snap.pages
    return result.target
