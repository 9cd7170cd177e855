"""The landing page in a real headless Chromium: what a person sees, read back from the rendered DOM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kv_exporter.manifest import write_manifest
from kv_exporter.reference import QWEN3_TTS
from kv_exporter.sidecar.report import human_bytes
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.support.constants import GIB, QWEN_ROW
from tests.support.exporter import exporter, simulated_gpu
from tests.support.manifests import reference_manifest
from tests.support.pages import vllm_page_with

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT_DIR = Path(os.environ.get("KV_EXPORTER_SCREENSHOT_DIR", tempfile.gettempdir()))


class Tables(HTMLParser):
    """Cell texts of every <table id=...> in a DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = dict(attrs).get("id") or ""
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self.tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None


def chromium(*args: str, timeout: float = 90) -> str:
    """Run headless Chromium in its own process group; on timeout stop that group (by its id)."""
    assert CHROMIUM
    with tempfile.TemporaryDirectory() as profile:
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
        ]
        process = subprocess.Popen(
            [CHROMIUM, *flags, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = process.communicate(timeout=timeout)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
    assert process.returncode == 0, process.returncode
    return out


@contextmanager
def exporter_with_one_engine(tmp_path: Path) -> Iterator[str]:
    write_manifest(tmp_path, reference_manifest(QWEN3_TTS, max_num_seqs=256))
    with (
        SimulatedEngine(vllm_page_with(17, "Qwen3-TTS")) as engine,
        exporter(tmp_path, [engine.url], simulated_gpu()) as e,
    ):
        yield e.url + "/"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (scripts/ensure-system-deps.sh)")
def test_landing_page_in_chromium(tmp_path: Path) -> None:
    with exporter_with_one_engine(tmp_path / "manifests") as url:
        dom = chromium("--dump-dom", url)
        shot = SCREENSHOT_DIR / "kv-exporter-landing.png"
        chromium(f"--screenshot={shot}", "--window-size=1500,1400", "--hide-scrollbars", url)
    tables = Tables()
    tables.feed(dom)
    gpus = tables.tables["gpus"]
    header, row = gpus[0], dict(zip(gpus[0], gpus[1], strict=True))
    assert "projected peak" in header and "headroom" in header
    projected = 60 * GIB + 2 * (256 - 17) * QWEN_ROW
    assert row["source"] == "SIMULATED"
    assert (row["total"], row["used"]) == ("80.00 GiB", "60.00 GiB")
    assert row["projected peak"] == human_bytes(projected)
    assert row["headroom"] == human_bytes(80 * GIB - projected)
    engines = [dict(zip(tables.tables["engines"][0], r, strict=True)) for r in tables.tables["engines"][1:]]
    shown = [(e["model"], e["page"], e["running / max_num_seqs"]) for e in engines]
    assert shown == [("Qwen3-TTS", "up", "17 / 256")]
    header, *rows = tables.tables["declarations"]
    decls = [dict(zip(header, r, strict=True)) for r in rows]
    request = next(d for d in decls if d["cache"] == "codec_decoder_request_cache")
    assert (request["ceiling rows"], request["estimate rows"]) == ("256", "17")
    assert request["ceiling"] == human_bytes(256 * QWEN_ROW) and request["estimate"] == human_bytes(17 * QWEN_ROW)
    assert "SIMULATED GPU" in dom
    assert shot.exists() and shot.stat().st_size > 20_000
