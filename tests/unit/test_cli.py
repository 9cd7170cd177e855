"""`kv-exporter serve | report | demo` as operators run them: real processes, stopped by pid."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_exporter.manifest import ProcessInfo, write_manifest
from kv_exporter.observation import Observation, ObservationState, OwnerObservation
from kv_exporter.reference import MIMO_AUDIO, QWEN3_TTS, REFERENCE_MODELS
from kv_exporter.sidecar.arguments import parse_simulated_gpu, parse_size
from kv_exporter.sidecar.buildinfo import build_info
from kv_exporter.sidecar.cli import main
from kv_exporter.sidecar.metrics_table import WEB_CONFIG_RELOAD
from kv_exporter.sidecar.units import human_bytes
from tests.support.constants import GIB, REPO
from tests.support.manifests import live_manifest, reference_manifest
from tests.support.sidecar import sidecar

CONTRACTS = REPO / "docs" / "CONTRACTS.md"


def metric_names(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def contract_names() -> set[str]:
    return set(re.findall(r"`(model_local_kv_[a-z_]+)", CONTRACTS.read_text()))


def test_parse_size() -> None:
    assert parse_size("80GiB") == 80 * GIB
    assert parse_size("512 MiB") == 512 << 20
    assert parse_size("1073741824") == GIB
    assert parse_size("1.5GiB") == 3 * GIB // 2
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("80GB")  # decimal units are ambiguous for GPU memory: refused
    assert parse_simulated_gpu("80GiB:60GiB") == (80 * GIB, 60 * GIB)
    for bad in ("80GiB", "1GiB:2GiB", "0:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_simulated_gpu(bad)


def test_human_bytes() -> None:
    assert human_bytes(4_653_056) == "4.44 MiB"
    assert human_bytes(720_896) == "704.00 KiB"
    assert human_bytes(147_456_000) == "140.62 MiB"
    assert human_bytes(25_165_824) == "24.00 MiB"
    assert human_bytes(261 * 720_896) == "179.44 MiB"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(-2 * GIB) == "-2.00 GiB"


def test_report_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_manifest(tmp_path, reference_manifest(QWEN3_TTS, max_num_seqs=256))
    assert main(["report", "--manifest-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "codec_decoder_request_cache" in out and "max_num_seqs 256" in out
    total = (256 + 256 + 31) * 4_653_056
    assert f"{human_bytes(total)} ({total} B)" in out
    row = next(line for line in out.splitlines() if "codec_decoder_working_copy" in line)
    assert row.split()[-5:] == ["256", "4.44", "MiB", "1.11", "GiB"]


def test_report_json_with_override_and_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_manifest(tmp_path, reference_manifest(QWEN3_TTS))
    write_manifest(tmp_path, reference_manifest(MIMO_AUDIO, stage=1))
    (tmp_path / "bad.json").write_text("[]")
    assert main(["report", "--manifest-dir", str(tmp_path), "--max-num-seqs", "17", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    qwen = next(m for m in doc["manifests"] if m["engine"]["model_name"] == "Qwen3-TTS")
    by_cache = {d["cache"]: d for d in qwen["declarations"]}
    assert by_cache["codec_decoder_request_cache"]["rows"] == 17
    assert by_cache["codec_decoder_request_cache"]["total_bytes"] == 17 * 4_653_056
    assert by_cache["codec_decoder_graph_pool"]["rows"] == 31
    mimo = next(m for m in doc["manifests"] if m["engine"]["model_name"] == "MiMo-Audio")
    assert mimo["total_bytes"] == (17 + 261) * 720_896
    assert doc["total_bytes"] == qwen["total_bytes"] + mimo["total_bytes"]
    assert doc["invalid"] == [
        {"path": str(tmp_path / "bad.json"), "reason": "wrong_type", "detail": doc["invalid"][0]["detail"]}
    ]


def test_report_puts_what_the_caches_hold_beside_what_they_declare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    owner = QWEN3_TTS.declarations[0][0]
    # The vocoder's cache lives inside steps: 0 B at the sample, 512 KiB at its peak.
    held = (OwnerObservation(owner, 3 * 4_718_592, 3), OwnerObservation("vocoder", 0, 0, 524_288))
    sample = Observation(ObservationState.OK, "", 10.0, time.time() - 2, 0.001, held, peaks_followed=True)
    # This test process wrote it, so the report (in this pid namespace) checks it live in /proc.
    alive = replace(reference_manifest(QWEN3_TTS, max_num_seqs=8), process=ProcessInfo.current(), observation=sample)
    write_manifest(tmp_path, alive)
    assert main(["report", "--manifest-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("observation: ok, sampled ") for line in lines)
    codec = next(
        line for line in lines if line.startswith(owner) and "MiB" in line and "codec" not in line[len(owner) :]
    )
    ceiling = (8 + 8 + 31) * 4_653_056
    held_now = human_bytes(3 * 4_718_592).split()
    assert codec.split()[1:] == [*human_bytes(ceiling).split(), *held_now, *held_now, "0", "B", "3"]
    vocoder = next(line for line in lines if line.startswith("vocoder"))
    # declares nothing: all of its peak is unexplained
    assert vocoder.split()[1:] == ["-", "0", "B", "512.00", "KiB", "512.00", "KiB", "0"]
    assert main(["report", "--manifest-dir", str(tmp_path), "--json"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)["manifests"]
    owners = {o["owner"]: o for o in doc["observation"]["owners"]}
    assert owners["vocoder"] == {
        "owner": "vocoder",
        "declared_ceiling_bytes": None,
        "observed_bytes": 0,
        "peak_bytes": 524_288,
        "unexplained_bytes": 524_288,
        "caches": 0,
    }
    assert owners[owner]["declared_ceiling_bytes"] == ceiling and doc["observation"]["state"] == "ok"


def test_report_unreadable_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--manifest-dir", str(tmp_path / "nope")]) == 2
    assert "cannot read manifest folder" in capsys.readouterr().err


def test_serve_starts_fast_and_small(tmp_path: Path) -> None:
    write_manifest(tmp_path, live_manifest(QWEN3_TTS))  # a live engine on no recorded GPU: the simulated one
    started = time.monotonic()
    with sidecar(tmp_path, "--manifest-dir", str(tmp_path), "--simulate-gpu", "80GiB:60GiB") as sc:
        body = sc.text()
        first_scrape = time.monotonic() - started
        rss_kib = sc.rss_kib()
        modules = subprocess.run(
            [
                sys.executable,
                "-c",
                "import kv_exporter.sidecar.cli, kv_exporter.sidecar.server, sys; print(sorted(sys.modules))",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert sc.stop() == 0  # SIGTERM is a clean stop
    assert 'source="simulated"' in body
    assert first_scrape < 1.5, first_scrape  # ~0.15 s measured; generous for a busy shared machine
    assert rss_kib < 40 * 1024, rss_kib
    assert "'torch'" not in modules and "'vllm'" not in modules


def test_serve_refuses_a_taken_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kv_exporter", "serve", "--manifest-dir", str(tmp_path), "--no-nvml",
             "--web.listen-address", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    assert result.returncode == 1
    assert "cannot serve" in result.stderr


@pytest.mark.parametrize("collection_timeout", ["3", "2.5"])
def test_the_collection_timeout_must_exceed_the_engine_timeout(
    collection_timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every collection reads the engines: a collection timeout within the engine timeout would call a slow engine stuck.
    with pytest.raises(SystemExit) as info:
        main(["serve", "--engine-timeout", "3", "--collection-timeout", collection_timeout])
    assert info.value.code == 2
    assert "--collection-timeout must be more than --engine-timeout" in capsys.readouterr().err


def test_demo_shows_every_contract_metric(tmp_path: Path) -> None:
    with sidecar(tmp_path, command="demo") as demo:
        text = demo.text()
        landing = demo.get("/")[2].decode()
        match = re.search(r"Folder <code>([^<]+)</code>", landing)
        assert match
        folder = Path(match.group(1))
        assert folder.is_dir()
        assert demo.stop() == 0
    missing = contract_names() - metric_names(text) - {WEB_CONFIG_RELOAD.name}  # that one needs --web.config.file
    assert not missing, missing
    for model in REFERENCE_MODELS:
        assert f'model_name="{model.model_name}"' in text
    # Every GPU series of the demo is labelled as simulated.
    gpu_lines = [line for line in text.splitlines() if line.startswith("model_local_kv_gpu_")]
    assert gpu_lines and all('source="simulated"' in line for line in gpu_lines)
    assert 'model_local_kv_manifests{state="invalid"} 1.0' in text
    assert not folder.exists()  # the demo cleans up after itself


def test_the_demos_report_says_its_exit_status_is_expected(tmp_path: Path) -> None:
    """A newcomer's first `kv-exporter report` on the demo's folder exits 1 for the deliberately broken file: the
    demo's banner says so, and so does the report."""
    with sidecar(tmp_path, command="demo") as demo:
        banner = demo.log()
        match = re.search(
            r"report: +kv-exporter report (\S+) +\(exits 1 for the invalid example, as expected\)", banner
        )
        assert match, banner
        report = subprocess.run(
            [sys.executable, "-m", "kv_exporter", "report", match.group(1)], capture_output=True, text=True, check=False
        )
    assert report.returncode == 1
    assert "invalid: " in report.stdout and "broken-example.json" in report.stdout
    assert "deliberately broken manifest" in report.stdout and "exit 1, as expected" in report.stdout


def test_a_report_on_other_invalid_manifests_adds_no_demo_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken.json").write_text("{")
    assert main(["report", str(tmp_path)]) == 1
    assert "demo" not in capsys.readouterr().out


def test_demo_running_count_moves() -> None:
    from kv_exporter.sidecar.demo import demo_engines

    qwen = demo_engines()[0]
    counts = {qwen.running(t) for t in range(0, 60, 5)}
    assert len(counts) > 5 and max(counts) <= qwen.max_num_seqs and min(counts) >= 0


def test_the_pre_toolkit_spellings_are_gone(capsys: pytest.CaptureFixture[str]) -> None:
    """0.1.0 shipped --listen-address, --log-level and --log.level=warning as deprecated spellings; they are refused."""
    from kv_exporter.sidecar.cli import build_parser

    for old in (["--listen-address", "127.0.0.1:0"], ["--log-level", "info"], ["--log.level", "warning"]):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args(["serve", "--manifest-dir", ".", *old])
        assert exited.value.code == 2
        error = capsys.readouterr().err
        assert old[0] in error or old[1] in error, error
    parsed = build_parser().parse_args(["serve", "--web.listen-address", "127.0.0.1:0", "--log.level", "warn"])
    assert parsed.log_level == "warn" and parsed.listen_addresses == ["127.0.0.1:0"]


def test_telemetry_path_and_json_logs(tmp_path: Path) -> None:
    args = ("--manifest-dir", str(tmp_path), "--no-nvml", "--web.telemetry-path", "/kv", "--log.format", "json")
    with sidecar(tmp_path, *args) as sc:
        assert sc.get("/kv")[0] == 200 and b"model_local_kv_manifests{" in sc.get("/kv")[2]
        assert sc.get("/metrics")[0] == 404
        assert b'<a href="/kv">/kv</a>' in sc.get("/")[2]
        assert sc.stop() == 0
    records = [json.loads(line) for line in sc.log().splitlines() if line.strip()]
    assert records and all(set(r) >= {"ts", "level", "logger", "msg"} for r in records)
    assert any(r["msg"].startswith("serving http://127.0.0.1:") and "/kv (manifests in" in r["msg"] for r in records)


def test_logfmt_is_the_default_and_quotes_what_it_must(tmp_path: Path) -> None:
    with sidecar(tmp_path, "--manifest-dir", str(tmp_path), "--no-nvml") as sc:
        assert sc.stop() == 0
    (line,) = [line for line in sc.log().splitlines() if "serving" in line]
    assert re.fullmatch(r'ts=\S+Z level=info logger=kv_exporter msg="serving http://127\.0\.0\.1:\d+/metrics .*"', line)


def test_version_names_the_revision_and_python(tmp_path: Path) -> None:
    out = run_kv_exporter("--version").strip()
    info = build_info()
    assert out == f"kv-exporter, version {info.version} (revision: {info.revision}, python: {info.python_version})"


def test_report_takes_its_folder_as_an_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_manifest(tmp_path, reference_manifest(QWEN3_TTS))
    assert main(["report", str(tmp_path)]) == 0
    positional = capsys.readouterr().out
    assert main(["report", "--manifest-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == positional and "codec_decoder_request_cache" in positional
    assert main(["report", str(tmp_path), "--manifest-dir", str(tmp_path / "other")]) == 2
    assert "two folders given" in capsys.readouterr().err


def test_report_says_a_missing_folder_once() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kv_exporter", "report", "/nonexistent/kv-exporter"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.count("/nonexistent/kv-exporter") == 1, result.stderr


def run_kv_exporter(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "kv_exporter", *args], capture_output=True, text=True, timeout=60, check=True
    ).stdout
