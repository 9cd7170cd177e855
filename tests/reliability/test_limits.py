"""The caps that keep one runaway declarer from blowing up the sidecar or Prometheus: each is a flag of the real
sidecar process, each is counted when hit, and everything under the cap is still exported."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kv_exporter.manifest import Manifest, write_manifest
from kv_exporter.observation import CudaMemory, Observation, ObservationState, OwnerObservation
from kv_exporter.reference import MIMO_AUDIO, MINICPM_O, QWEN3_TTS, ReferenceModel
from kv_exporter.sidecar.cli import build_parser
from kv_exporter.sidecar.engine_page import scan_page
from kv_exporter.sidecar.families import families
from kv_exporter.sidecar.liveness import State, Verdict
from kv_exporter.sidecar.records import GpuResult, ManifestEntry, PageResult
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from kv_exporter.sidecar.snapshot import build_snapshot, manifest_series
from tests.support.constants import SIMULATE_GPU
from tests.support.manifests import MODEL, live_manifest, reference_manifest
from tests.support.pages import vllm_page_with
from tests.support.scrape import declared_models, manifest_states, pick
from tests.support.sidecar import sidecar


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


def test_total_series_cap_drops_the_newest_manifests_whole(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    oldest, middle, newest = (engine_named(n, 1_764_480_000.0 + i) for i, n in enumerate(("a-old", "b-mid", "c-new")))
    # Written in another order than their ages: `written_at` decides, not the files' mtimes.
    paths = {m.engine.model_name: write_manifest(folder, m) for m in (newest, middle, oldest)}
    cap = manifest_series(oldest) + manifest_series(middle) + 1
    with sidecar(tmp_path, "--manifest-dir", str(folder), "--max-series", str(cap), *SIMULATE_GPU) as sc:
        for _ in range(3):
            s = sc.samples()
            assert pick(s, "model_local_kv_series_limit_dropped_manifests") == 1
            assert declared_models(s) == {"a-old", "b-mid"}
            assert not any(dict(ls).get("model_name") == "c-new" for _, ls in s)  # no series of it at all
            assert manifest_states(s) == (3, 0, 0)  # left out, but still a live manifest
        status, _, body = sc.get("/")
        assert status == 200 and b"left out of the metrics: over --max-series" in body
        paths["a-old"].unlink()  # room again
        s = sc.samples()
        assert pick(s, "model_local_kv_series_limit_dropped_manifests") == 0
        assert declared_models(s) == {"b-mid", "c-new"}
        assert sc.stop() == 0
    log = sc.log()
    assert log.count("series cap (--max-series") == 1, log  # once when it starts, not per scrape
    assert log.count("series cap no longer reached") == 1, log


def test_the_series_accounting_matches_the_families() -> None:
    """manifest_series counts what one live manifest really adds to the page: its per-declaration, per-owner and
    per-engine series (per-GPU and per-page ones are bounded by the hardware and the configuration)."""
    owners = (OwnerObservation(QWEN3_TTS.declarations[0][0], 1, 1), OwnerObservation("vocoder", 1, 1))
    sample = Observation(ObservationState.OK, "", 10.0, 1_764_480_000.0, 0.0, owners, CudaMemory(1, 1))
    manifest = dataclasses.replace(reference_manifest(QWEN3_TTS), observation=sample)
    entry = ManifestEntry("/m.json", manifest, Verdict(State.LIVE, "test"))
    page = PageResult("http://e/metrics", scan_page(vllm_page_with(3, QWEN3_TTS.model_name)), None, 0.0)
    # With its engine's page read, the manifest's page reaches the bound exactly.
    snapshot = build_snapshot([entry], [page], GpuResult(enabled=False, source=None), taken_at=1_764_480_001.0)
    per_manifest = [f for f in families(snapshot) if {"model_name", "engine"} <= set(getattr(f, "label_names", ()))]
    assert sum(len(f.samples) for f in per_manifest) == manifest_series(manifest)


@pytest.mark.parametrize(
    "flag",
    [
        "--max-series=0",
        "--manifest-max-declarations=0",
        "--manifest-max-bytes=0",
        "--max-series=x",
        "--web.max-connections=0",
    ],
)
def test_a_cap_below_one_is_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", flag])
    assert info.value.code == 2
    assert flag.split("=")[0] in capsys.readouterr().err
