"""The caps that keep one runaway declarer from blowing up the sidecar or Prometheus: each is a flag of the real
sidecar process, each is counted when hit, and everything under the cap is still exported."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kv_exporter.manifest import DEFAULT_LIMITS, Manifest, PodInfo, write_manifest
from kv_exporter.observation import (
    CudaMemory,
    CudaUnavailable,
    CudaWarm,
    Observation,
    ObservationState,
    OwnerObservation,
)
from kv_exporter.reference import MIMO_AUDIO, MINICPM_O, QWEN3_TTS, ReferenceModel
from kv_exporter.sidecar import budget
from kv_exporter.sidecar.budget import (
    DEFAULT_MAX_LABEL_BYTES,
    DEFAULT_MAX_SERIES,
    SERIES_LINE_BYTES,
    SERIES_PER_PAGE_ENGINE,
    manifest_cost,
)
from kv_exporter.sidecar.cli import build_parser
from kv_exporter.sidecar.engine_page import DEFAULT_MAX_PAGE_BYTES, scan_page
from kv_exporter.sidecar.exposition import Exposition
from kv_exporter.sidecar.families import families
from kv_exporter.sidecar.liveness import State, Verdict
from kv_exporter.sidecar.records import GpuResult, ManifestEntry, PageResult, engine_key
from kv_exporter.sidecar.running import Running, RunningState
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from kv_exporter.sidecar.snapshot import build_snapshot
from tests.support.constants import SIMULATE_GPU
from tests.support.manifests import MODEL, huge_manifest, live_manifest, reference_manifest
from tests.support.pages import vllm_page_with
from tests.support.scrape import declared_models, manifest_states, parse, pick
from tests.support.sidecar import serve_args, sidecar

LABEL_VALUE = re.compile(rb'="((?:[^"\\]|\\.)*)"')  # a label value as the page writes it


def test_manifest_size_cap(tmp_path: Path) -> None:
    small, big = live_manifest(MINICPM_O), live_manifest(QWEN3_TTS)
    sizes = len(small.to_json().encode()), len(big.to_json().encode())
    limit = sum(sizes) // 2
    assert sizes[0] < limit < sizes[1]
    write_manifest(tmp_path / "m", small)
    write_manifest(tmp_path / "m", big)
    args = ("--manifest-dir", str(tmp_path / "m"), "--manifest-max-bytes", str(limit), *SIMULATE_GPU)
    with sidecar(tmp_path, *args) as sc:
        for _ in range(3):
            s = sc.samples()
            assert manifest_states(s) == (1, 0, 1)
            assert pick(s, "model_local_kv_manifest_errors_total", reason="too_large") == 1  # once per file version
            assert declared_models(s) == {MINICPM_O.model_name}
        assert sc.stop() == 0
    assert sc.log().count("too_large") == 1


def test_declarations_per_manifest_cap(tmp_path: Path) -> None:
    assert (len(MIMO_AUDIO.declarations), len(QWEN3_TTS.declarations)) == (2, 3)
    write_manifest(tmp_path / "m", live_manifest(MIMO_AUDIO))
    write_manifest(tmp_path / "m", live_manifest(QWEN3_TTS))
    args = ("--manifest-dir", str(tmp_path / "m"), "--manifest-max-declarations", "2", *SIMULATE_GPU)
    with sidecar(tmp_path, *args) as sc:
        s = sc.samples()
        assert manifest_states(s) == (1, 0, 1)
        assert pick(s, "model_local_kv_manifest_errors_total", reason="too_many_declarations") == 1
        assert declared_models(s) == {MIMO_AUDIO.model_name}
        assert sc.stop() == 0


def test_engine_page_size_cap(tmp_path: Path) -> None:
    write_manifest(tmp_path / "m", live_manifest())
    page = vllm_page_with(17, MODEL)
    assert len(page) > 16 << 10  # the recorded real vLLM page, ~50 KB
    with SimulatedEngine(page) as engine:
        args = ("--manifest-dir", str(tmp_path / "m"), "--engine-url", engine.url, "--engine-max-bytes", "16KiB")
        with sidecar(tmp_path, *args) as sc:
            for count in (1, 2):
                s = sc.samples()
                assert (
                    pick(s, "model_local_kv_engine_page_errors_total", target=engine.url, reason="too_large") == count
                )
                assert pick(s, "model_local_kv_engine_page_up", target=engine.url) == 0
            assert sc.stop() == 0


def engine_named(name: str, written_at: float) -> Manifest:
    manifest = live_manifest(ReferenceModel(name, MINICPM_O.declarations))
    return dataclasses.replace(manifest, written_at=written_at)


def test_total_series_cap_drops_the_last_manifests_by_file_name_whole(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    # Dated against their file-name order: the names decide, not `written_at` (which the writer sets).
    first, second, third = (engine_named(n, 1_764_480_000.0 - i) for i, n in enumerate(("a-old", "b-mid", "c-new")))
    paths = {m.engine.model_name: write_manifest(folder, m) for m in (third, second, first)}
    cap = manifest_cost(first).series + manifest_cost(second).series + 1
    with sidecar(tmp_path, "--manifest-dir", str(folder), "--max-series", str(cap), *SIMULATE_GPU) as sc:
        for _ in range(3):
            s = sc.samples()
            assert pick(s, "model_local_kv_series_limit_dropped_manifests") == 1
            assert declared_models(s) == {"a-old", "b-mid"}
            assert not any(dict(ls).get("model_name") == "c-new" for _, ls in s)  # no series of it at all
            assert manifest_states(s) == (3, 0, 0)  # left out, but still a live manifest
        status, _, body = sc.get("/")
        assert status == 200 and b"left out of the metrics: over --max-series or --max-label-bytes" in body
        paths["a-old"].unlink()  # room again
        s = sc.samples()
        assert pick(s, "model_local_kv_series_limit_dropped_manifests") == 0
        assert declared_models(s) == {"b-mid", "c-new"}
        assert sc.stop() == 0
    log = sc.log()
    assert log.count("series cap reached (--max-series") == 1, log  # once when it starts, not per scrape
    assert log.count("series cap no longer reached") == 1, log


@pytest.mark.parametrize("hog_name", ["0-hog", "z-hog"])
def test_a_manifest_that_cannot_fit_is_left_out_alone(hog_name: str) -> None:
    """Today's main: a hog dated 0 (taken first) left every other engine out; one that sorts first by name now
    must not either. And rewriting `written_at` (as the sampler does) never changes who is left out."""
    hog = dataclasses.replace(huge_manifest(0), written_at=0.0)
    hog = dataclasses.replace(hog, engine=dataclasses.replace(hog.engine, model_name=hog_name))
    others = [engine_named(n, 1_764_480_000.0 + i) for i, n in enumerate(("b-one", "c-two", "d-three"))]
    cap = budget.SeriesCap(max_series=sum(manifest_cost(m).series for m in others) + 1)
    assert manifest_cost(hog).series > cap.max_series - sum(manifest_cost(m).series for m in others)

    def entry(manifest: Manifest) -> ManifestEntry:
        return ManifestEntry(f"/m/{manifest.engine.model_name}.json", manifest, Verdict(State.LIVE, "test"))

    for shift in (0.0, 5.0, -1e9):  # written_at moved by the writer between scrapes
        entries = [entry(dataclasses.replace(m, written_at=m.written_at + shift)) for m in (hog, *others)]
        limited = budget.limit_series(entries, (), cap)
        assert [e.path for e in limited.dropped] == [f"/m/{hog_name}.json"]
        assert sorted(e.manifest.engine.model_name for e in limited.kept if e.manifest) == ["b-one", "c-two",
                                                                                           "d-three"]  # fmt: skip


@pytest.mark.parametrize(
    ("cuda", "unavailable"),
    [
        (CudaMemory(1, 1), None),
        (CudaMemory(1, 1, 2, 2, 1, 0, 0, CudaWarm(1, 1, 2, 0)), None),
        (None, CudaUnavailable.NOT_CUDA),
    ],
    ids=["cuda", "cuda-after-warm-up", "cpu-worker"],
)
def test_the_series_accounting_matches_the_families(
    cuda: CudaMemory | None, unavailable: CudaUnavailable | None
) -> None:
    """manifest_cost counts what one live manifest really adds to the page: its per-declaration, per-owner and
    per-engine series (per-GPU and per-page ones are bounded by the hardware and the configuration), and the bytes
    of their label values as the page writes them (escapes included)."""
    owners = (OwnerObservation(QWEN3_TTS.declarations[0][0], 1, 1), OwnerObservation('vo"c\\oder', 1, 1))
    sample = Observation(
        ObservationState.OK, "", 10.0, 1_764_480_000.0, 0.0, owners, cuda, cuda_unavailable=unavailable
    )
    pod = PodInfo("tts-7d9f8b6c5-x2x8q", "inférence", "vllm")
    manifest = dataclasses.replace(reference_manifest(QWEN3_TTS), observation=sample, pod=pod)
    entry = ManifestEntry("/m.json", manifest, Verdict(State.LIVE, "test"))
    page = PageResult("http://e/metrics", scan_page(vllm_page_with(3, QWEN3_TTS.model_name)), None, 0.0)
    # With its worker's step record and its engine's page read (their difference too), the manifest's page reaches
    # the bound exactly.
    workers = {engine_key(manifest): Running(RunningState.STEPPING, 3, 5)}
    snapshot = build_snapshot(
        [entry], [page], GpuResult(enabled=False, source=None), taken_at=1_764_480_001.0, workers=workers
    )
    per_manifest = [f for f in families(snapshot) if {"model_name", "engine"} <= set(getattr(f, "label_names", ()))]
    cost = manifest_cost(manifest)
    assert sum(len(f.samples) for f in per_manifest) == cost.series
    text = Exposition().render(per_manifest, "text/plain; version=0.0.4")
    assert text is not None
    assert sum(map(len, LABEL_VALUE.findall(text))) == cost.label_bytes
    for line in text.splitlines():  # and the rest of each line is within its bound
        if not line.startswith(b"#"):
            assert len(line) + 1 - sum(map(len, LABEL_VALUE.findall(line))) <= SERIES_LINE_BYTES


def test_a_cost_is_remembered_per_manifest_object_and_forgotten_with_it() -> None:
    """Costs are kept by object identity while the store keeps a file's parse: a freed manifest's id, reused by the
    next one, must not bring back its cost, and the memo must not outlive the manifests."""
    before = len(budget._costs)
    sizes = [huge_manifest(0), live_manifest(QWEN3_TTS), live_manifest(MINICPM_O)]
    expected = [budget._cost(m) for m in sizes]
    for _ in range(50):  # each round frees a manifest whose id the next one is likely to get
        for manifest, cost in zip(sizes, expected, strict=True):
            copy = dataclasses.replace(manifest)
            assert manifest_cost(copy) == cost
            assert manifest_cost(copy) is manifest_cost(copy)  # the same object: costed once
            del copy
    assert len(budget._costs) == before


def test_a_folder_of_files_just_under_the_size_cap_keeps_the_page_small(tmp_path: Path) -> None:
    """Measured: a page of 6.7 MB. Today's main made one of 27.5 MB from these 12 files (39.9 MB with schema
    version 2's pod labels): the series cap alone allowed them all."""
    folder = tmp_path / "m"
    manifests = [huge_manifest(n) for n in range(12)]
    for manifest in manifests:
        size = write_manifest(folder, manifest).stat().st_size
        assert 0.9 * DEFAULT_LIMITS.max_bytes < size < DEFAULT_LIMITS.max_bytes, size
    cost = manifest_cost(manifests[0])
    kept = DEFAULT_MAX_LABEL_BYTES // cost.label_bytes
    with sidecar(tmp_path, *serve_args(folder)) as sc:
        for _ in range(2):
            status, _, body = sc.get()
            assert status == 200
            s = parse(body.decode())
            dropped = pick(s, "model_local_kv_series_limit_dropped_manifests")
            # Some left out while the page stays far under --max-series: the label budget is what binds.
            assert dropped > 0 and len(s) < DEFAULT_MAX_SERIES // 2, (dropped, len(s))
            assert dropped == len(manifests) - kept
            assert len(declared_models(s)) == kept
            assert len(body) < DEFAULT_MAX_LABEL_BYTES + SERIES_LINE_BYTES * len(s) + (64 << 10)
        assert sc.stop() == 0
    print(f"\n12 manifests just under 1 MiB: a page of {len(body) / 1e6:.1f} MB, {len(s)} series")


def test_a_page_of_sixty_thousand_engines_stays_under_the_series_cap(tmp_path: Path) -> None:
    """Engines only a page shows count against --max-series too. Today's main: 180,000 series from this page."""
    page = "".join(f'vllm:num_requests_running{{engine="0",model_name="m-{i:05d}"}} 1\n' for i in range(60_000))
    assert len(page) < DEFAULT_MAX_PAGE_BYTES
    kept = DEFAULT_MAX_SERIES // SERIES_PER_PAGE_ENGINE
    with SimulatedEngine(page.encode()) as engine:
        args = ("--manifest-dir", str(tmp_path / "m"), "--engine-url", engine.url, *SIMULATE_GPU)
        with sidecar(tmp_path, *args) as sc:
            for _ in range(2):
                s = sc.samples()
                assert pick(s, "model_local_kv_engine_page_up", target=engine.url) == 1
                assert pick(s, "model_local_kv_series_limit_dropped_engines") == 60_000 - kept
                engines = {dict(ls)["model_name"] for n, ls in s if n == "model_local_kv_engine_up"}
                assert engines == {f"m-{i:05d}" for i in range(kept)}  # the first ones in key order
                assert sum(1 for _, ls in s if "model_name" in dict(ls)) <= DEFAULT_MAX_SERIES
            assert sc.stop() == 0


@pytest.mark.parametrize(
    "flag",
    [
        "--max-series=0",
        "--manifest-max-declarations=0",
        "--manifest-max-bytes=0",
        "--max-series=x",
        "--web.max-connections=0",
        "--max-label-bytes=0",
    ],
)
def test_a_cap_below_one_is_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", flag])
    assert info.value.code == 2
    assert flag.split("=")[0] in capsys.readouterr().err
