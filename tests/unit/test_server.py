"""The exporter over real HTTP: every fault in the issue answers 200 with the right *_up and error figures."""

from __future__ import annotations

import gzip
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from kv_exporter.gpu import NvmlReader
from kv_exporter.manifest import write_manifest
from kv_exporter.reference import MIMO_AUDIO, QWEN3_TTS
from kv_exporter.sidecar.server import parse_listen_address
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.support.constants import GIB, QWEN_ROW, UUID0
from tests.support.exporter import exporter, simulated_gpu
from tests.support.manifests import reference_manifest
from tests.support.net import closed_port_url
from tests.support.pages import VLLM_PAGE, vllm_page_with
from tests.support.scrape import Samples, absent, pick


@pytest.fixture
def qwen_dir(tmp_path: Path) -> Path:
    write_manifest(tmp_path, reference_manifest(QWEN3_TTS, max_num_seqs=256))
    return tmp_path


def test_healthy_engine(qwen_dir: Path) -> None:
    with (
        SimulatedEngine(vllm_page_with(17, "Qwen3-TTS")) as engine,
        exporter(qwen_dir, [engine.url], simulated_gpu()) as e,
    ):
        s = e.samples()
    labels = {"model_name": "Qwen3-TTS", "cache": "codec_decoder_request_cache"}
    assert pick(s, "model_local_kv_ceiling_bytes", **labels) == 256 * QWEN_ROW
    assert pick(s, "model_local_kv_estimated_bytes", **labels) == 17 * QWEN_ROW
    assert pick(s, "model_local_kv_engine_up", model_name="Qwen3-TTS") == 1
    assert pick(s, "model_local_kv_running_sequences", model_name="Qwen3-TTS") == 17
    assert pick(s, "model_local_kv_engine_page_up", target=engine.url) == 1
    peak = pick(s, "model_local_kv_gpu_projected_peak_bytes", UUID=UUID0, source="simulated")
    assert peak == 60 * GIB + 2 * (256 - 17) * QWEN_ROW
    assert pick(s, "model_local_kv_gpu_headroom_bytes", gpu="0") == 80 * GIB - peak
    assert pick(s, "model_local_kv_nvml_up") == 1
    assert pick(s, "model_local_kv_manifests", state="live") == 1


def assert_engine_down(s: Samples, url: str, reason: str) -> None:
    assert pick(s, "model_local_kv_engine_up", model_name="Qwen3-TTS") == 0
    assert pick(s, "model_local_kv_engine_page_up", target=url) == 0
    assert pick(s, "model_local_kv_engine_page_errors_total", target=url, reason=reason) >= 1
    assert absent(s, "model_local_kv_running_sequences")
    labels = {"model_name": "Qwen3-TTS", "cache": "codec_decoder_request_cache"}
    assert pick(s, "model_local_kv_estimated_bytes", **labels) == 0
    peak = pick(s, "model_local_kv_gpu_projected_peak_bytes", gpu="0")
    assert peak == 60 * GIB + 2 * 256 * QWEN_ROW  # an upper bound: every row still to come


def test_engine_down(qwen_dir: Path) -> None:
    url = closed_port_url()
    with exporter(qwen_dir, [url], simulated_gpu()) as e:
        assert_engine_down(e.samples(), url, "unreachable")


def test_engine_slow(qwen_dir: Path) -> None:
    with (
        SimulatedEngine(VLLM_PAGE.read_bytes(), fault="slow", delay_s=3) as engine,
        exporter(qwen_dir, [engine.url], simulated_gpu(), fetch_timeout_s=0.3) as e,
    ):
        started = time.monotonic()
        s = e.samples()
        assert time.monotonic() - started < 2
        assert_engine_down(s, engine.url, "timeout")


def test_engine_returns_garbage(qwen_dir: Path) -> None:
    with (
        SimulatedEngine(b"\x00\xffnot a metrics page\n" * 100) as engine,
        exporter(qwen_dir, [engine.url], simulated_gpu()) as e,
    ):
        assert_engine_down(e.samples(), engine.url, "no_running_series")


def test_engine_huge_page(qwen_dir: Path) -> None:
    with (
        SimulatedEngine(vllm_page_with(17, "Qwen3-TTS") * 50) as engine,
        exporter(qwen_dir, [engine.url], simulated_gpu(), max_page_bytes=1 << 20) as e,
    ):
        assert_engine_down(e.samples(), engine.url, "too_large")


def test_one_engine_down_does_not_hide_the_other(tmp_path: Path) -> None:
    write_manifest(tmp_path, reference_manifest(QWEN3_TTS))
    write_manifest(tmp_path, reference_manifest(MIMO_AUDIO))
    down = closed_port_url()
    with (
        SimulatedEngine(vllm_page_with(3, "MiMo-Audio")) as engine,
        exporter(tmp_path, [down, engine.url], simulated_gpu()) as e,
    ):
        s = e.samples()
    assert pick(s, "model_local_kv_engine_up", model_name="MiMo-Audio") == 1
    assert pick(s, "model_local_kv_engine_up", model_name="Qwen3-TTS") == 0


def test_nvml_absent_for_real(qwen_dir: Path) -> None:
    # No NVIDIA driver on this machine: the real binding fails in nvmlInit and the exporter says so.
    with (
        SimulatedEngine(vllm_page_with(1, "Qwen3-TTS")) as engine,
        exporter(qwen_dir, [engine.url], NvmlReader()) as e,
    ):
        s = e.samples()
    assert pick(s, "model_local_kv_nvml_up") == 0
    assert pick(s, "model_local_kv_nvml_errors_total", reason="library_not_found") >= 1
    assert absent(s, "model_local_kv_gpu_memory_total_bytes")
    assert pick(s, "model_local_kv_engine_up", model_name="Qwen3-TTS") == 1
    assert pick(s, "model_local_kv_ceiling_bytes", cache="codec_decoder_request_cache") == 256 * QWEN_ROW


def test_no_nvml(qwen_dir: Path) -> None:
    with exporter(qwen_dir, [], None) as e:
        s = e.samples()
    assert pick(s, "model_local_kv_nvml_up") == 0
    assert absent(s, "model_local_kv_nvml_errors_total")
    assert absent(s, "model_local_kv_gpu_projected_peak_bytes")


def test_no_manifests(tmp_path: Path) -> None:
    with (
        SimulatedEngine(vllm_page_with(4, "Qwen3-TTS")) as engine,
        exporter(tmp_path, [engine.url], simulated_gpu()) as e,
    ):
        s = e.samples()
    assert [pick(s, "model_local_kv_manifests", state=x) for x in ("live", "stale", "invalid")] == [0, 0, 0]
    assert absent(s, "model_local_kv_ceiling_bytes")
    # The engine runs but declares nothing here: the "manifests missing" signal.
    assert pick(s, "model_local_kv_engine_manifests", model_name="Qwen3-TTS") == 0
    assert absent(s, "model_local_kv_gpu_projected_peak_bytes")  # no engine of this exporter uses the GPU


def test_missing_manifest_folder(tmp_path: Path) -> None:
    with exporter(tmp_path / "absent", [], simulated_gpu()) as e:
        s = e.samples()
    assert pick(s, "model_local_kv_manifest_errors_total", reason="folder_unreadable") == 1


def test_bad_manifest_beside_good_ones(qwen_dir: Path) -> None:
    (qwen_dir / "truncated.json").write_text('{"schema_version": 1, ')
    (qwen_dir / "wrong.json").write_text('{"schema_version": 1}')
    with (
        SimulatedEngine(vllm_page_with(17, "Qwen3-TTS")) as engine,
        exporter(qwen_dir, [engine.url], simulated_gpu()) as e,
    ):
        for _ in range(3):
            s = e.samples()
    assert pick(s, "model_local_kv_manifests", state="invalid") == 2
    assert pick(s, "model_local_kv_manifests", state="live") == 1
    # Counted once per file version, not once per scrape.
    assert pick(s, "model_local_kv_manifest_errors_total", reason="invalid_json") == 1
    assert pick(s, "model_local_kv_manifest_errors_total", reason="missing_field") == 1
    assert pick(s, "model_local_kv_estimated_bytes", cache="codec_decoder_request_cache") == 17 * QWEN_ROW


def test_concurrent_scrapes_share_one_collection(qwen_dir: Path) -> None:
    with (
        SimulatedEngine(vllm_page_with(2, "Qwen3-TTS"), fault="slow", delay_s=0.5) as engine,
        exporter(qwen_dir, [engine.url], simulated_gpu(), fetch_timeout_s=3) as e,
    ):
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(e.get()[0])) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert results == [200] * 6
        assert engine.requests == 1  # one fetch per engine for all six scrapes
        e.get()
        assert engine.requests == 2


def test_openmetrics_and_gzip(qwen_dir: Path) -> None:
    with exporter(qwen_dir, [], simulated_gpu()) as e:
        status, headers, body = e.get(headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert status == 200
        assert headers["Content-Type"].startswith("application/openmetrics-text")
        text = body.decode()
        assert text.endswith("# EOF\n")
        names = {f.name for f in parse_openmetrics(text)}  # type: ignore[no-untyped-call]
        assert "model_local_kv_manifest_errors" in names
        status, headers, body = e.get(headers={"Accept-Encoding": "gzip"})
        assert headers["Content-Encoding"] == "gzip"
        assert b"model_local_kv_ceiling_bytes" in gzip.decompress(body)
        status, headers, body = e.get()
        assert headers["Content-Type"].startswith("text/plain")
        assert "Content-Encoding" not in headers


def test_other_endpoints(qwen_dir: Path) -> None:
    with exporter(qwen_dir, [], simulated_gpu()) as e:
        assert e.get("/healthz")[0] == 200
        status, headers, body = e.get("/")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert b"codec_decoder_request_cache" in body
        assert e.get("/nope")[0] == 404
        request = urllib.request.Request(e.url + "/metrics", method="HEAD")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200 and response.read() == b""


def test_landing_escapes_manifest_text(tmp_path: Path) -> None:
    from kv_exporter.reference import ReferenceModel

    evil = ReferenceModel("<script>alert(1)</script>", QWEN3_TTS.declarations)
    write_manifest(tmp_path, reference_manifest(evil))
    with exporter(tmp_path, [], simulated_gpu()) as e:
        body = e.get("/")[2].decode()
    assert "<script>" not in body
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body


def test_listen_address_parsing() -> None:
    assert parse_listen_address(":9477") == ("", 9477)
    assert parse_listen_address("127.0.0.1:9477") == ("127.0.0.1", 9477)
    assert parse_listen_address("[::1]:9477") == ("::1", 9477)
    for bad in ("9477", "host:", "host:port", ":70000"):
        with pytest.raises(ValueError):
            parse_listen_address(bad)
