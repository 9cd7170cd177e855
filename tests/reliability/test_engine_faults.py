"""Engine page faults against the real sidecar process: /metrics answers 200 throughout, within the engine
timeout, with the engine marked down and the failure counted once per scrape by reason; the projection falls back
to its upper bound; and the engine is read again as soon as it is healthy."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kv_exporter.manifest import Manifest, write_manifest
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.support.constants import GPU_USED, SIMULATE_GPU
from tests.support.manifests import MODEL, ceiling_bytes, estimated_bytes, live_manifest
from tests.support.pages import vllm_page_with
from tests.support.scrape import Samples, absent, pick, total
from tests.support.sidecar import Sidecar, sidecar

ENGINE_TIMEOUT_S = 1.0
RUNNING = 17
SCRAPES_PER_FAULT = 3

# fault mode of the stand-in engine -> the reason the sidecar must count
FAULTS = {
    "refused": "unreachable",  # nothing listens on the port
    "hang": "timeout",  # accepts, reads the request, never answers
    "status_500": "http_status",
    "truncated": "truncated",  # closes half-way through its Content-Length
    "huge": "too_large",  # 50 MB, announced in Content-Length
    "huge_streamed": "too_large",  # 50 MB, close-delimited: only counting tells
    "html": "no_running_series",  # a login page where the metrics should be
    "json": "no_running_series",
    # HTTP framing: a trickle of any part of the answer costs --engine-timeout, with the same reason every time.
    "trickle_status": "timeout",
    "trickle_headers": "timeout",
    "interim": "timeout",  # a `100 Continue` now and then: today's main waited for ever
    "trickle_chunked": "timeout",
    "interim_flood": "bad_response",  # what Go's client refuses is refused
    "bad_chunk": "bad_response",
    "two_lengths": "bad_response",
}
GO_TAKES = ("early_hints", "chunked")  # framings Go's client (Prometheus') reads: read too


def assert_engine_read(s: Samples, manifest: Manifest, url: str) -> None:
    assert pick(s, "model_local_kv_engine_up", model_name=MODEL) == 1
    assert pick(s, "model_local_kv_engine_page_up", target=url) == 1
    assert pick(s, "model_local_kv_running_sequences", model_name=MODEL) == RUNNING
    estimate = estimated_bytes(manifest, RUNNING)
    assert total(s, "model_local_kv_estimated_bytes") == estimate
    assert pick(s, "model_local_kv_gpu_projected_peak_bytes") == GPU_USED + ceiling_bytes(manifest) - estimate


def assert_engine_down(s: Samples, manifest: Manifest, url: str, reason: str, count: int) -> None:
    assert pick(s, "model_local_kv_engine_up", model_name=MODEL) == 0
    assert pick(s, "model_local_kv_engine_page_up", target=url) == 0
    assert pick(s, "model_local_kv_engine_page_errors_total", target=url, reason=reason) == count
    assert absent(s, "model_local_kv_running_sequences")
    # Every max_num_seqs row counts as still to come: the projected peak is an upper bound.
    fallback = estimated_bytes(manifest, None)
    assert pick(s, "model_local_kv_gpu_projected_peak_bytes") == GPU_USED + ceiling_bytes(manifest) - fallback
    assert pick(s, "model_local_kv_manifests", state="live") == 1


def timed_samples(sc: Sidecar) -> tuple[Samples, float]:
    started = time.monotonic()
    samples = sc.samples()
    return samples, time.monotonic() - started


@pytest.mark.parametrize("mode", list(FAULTS))
def test_engine_fault_then_recovery(tmp_path: Path, mode: str) -> None:
    manifest = live_manifest(max_num_seqs=256)
    write_manifest(tmp_path / "m", manifest)
    args = ("--manifest-dir", str(tmp_path / "m"), "--engine-timeout", str(ENGINE_TIMEOUT_S), *SIMULATE_GPU)
    with (
        SimulatedEngine(vllm_page_with(RUNNING, MODEL)) as engine,
        sidecar(tmp_path, *args, "--engine-url", engine.url) as sc,
    ):
        assert_engine_read(sc.samples(), manifest, engine.url)
        engine.set(mode)
        rss_kib = []
        for count in range(1, (2 if mode.startswith("huge") else 1) * SCRAPES_PER_FAULT + 1):
            samples, seconds = timed_samples(sc)
            assert_engine_down(samples, manifest, engine.url, FAULTS[mode], count)
            assert seconds < ENGINE_TIMEOUT_S + 1.5, seconds  # a bad engine never stalls the scrape
            rss_kib.append(sc.rss_kib())
        engine.set("ok")
        assert_engine_read(sc.samples(), manifest, engine.url)
        assert sc.stop() == 0
    # 50 MB pages are never held: at most --engine-max-bytes (4 MiB) is read per scrape, and freed at once. A read
    # may raise the allocator's high-water mark by a page; scrapes must not add up (the read used to stay
    # referenced from the error's traceback until a cyclic GC: +4 MiB a scrape, +20 MiB over these 6).
    assert max(rss_kib) - rss_kib[0] < 6 * 1024, rss_kib
    log = sc.log()
    assert log.count(f"engine page {engine.url}: {FAULTS[mode]}") == 1, log  # logged when it breaks, not per scrape
    assert log.count(f"engine page {engine.url}: readable again") == 1, log


@pytest.mark.parametrize("mode", GO_TAKES)
def test_a_framing_go_reads_is_read(tmp_path: Path, mode: str) -> None:
    manifest = live_manifest(max_num_seqs=256)
    write_manifest(tmp_path / "m", manifest)
    args = ("--manifest-dir", str(tmp_path / "m"), *SIMULATE_GPU)
    with (
        SimulatedEngine(vllm_page_with(RUNNING, MODEL), fault=mode) as engine,
        sidecar(tmp_path, *args, "--engine-url", engine.url) as sc,
    ):
        for _ in range(2):
            assert_engine_read(sc.samples(), manifest, engine.url)
        assert sc.stop() == 0
