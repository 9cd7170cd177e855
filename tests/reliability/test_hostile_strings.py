"""Text that is not text, against the real sidecar process and `kv-exporter report`: file names that are not UTF-8 or
hold escape sequences, JSON keys with lone surrogates and control characters, very long ones, and engine-page label
values no manifest could hold. Either the input is refused with a reason, or its text is shown escaped; /metrics,
the landing page and the report keep answering, as UTF-8 without a control character, and every other manifest is
still exported. (Before: one such file name made the landing page answer 500 and the report die with a traceback;
a page's model name with an escape sequence reached /metrics as it was.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kv_exporter.manifest import write_manifest
from kv_exporter.reference import MINICPM_O
from kv_exporter.sidecar.simulated_engine import SimulatedEngine, vllm_page
from tests.support.constants import SIMULATE_GPU
from tests.support.manifests import MODEL, live_manifest
from tests.support.scrape import declared_models, manifest_states, parse, pick
from tests.support.sidecar import run_command, serve_args, sidecar

CONTROL = tuple(chr(c) for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\n")


def plain_text(data: bytes) -> str:
    """`data` as strict UTF-8 with no control character but line ends: what a page, a log or a terminal may get."""
    text = data.decode("utf-8")
    assert not any(c in text for c in CONTROL), [c for c in CONTROL if c in text]
    return text


def odd_folder(folder: Path) -> None:
    """A good manifest; a good one under a file name that is not UTF-8 and holds an escape sequence; a bad one under
    another such name, whose unknown key holds a lone surrogate, an escape sequence and 5,000 more characters."""
    write_manifest(folder, live_manifest())
    raw = os.fsencode(folder)
    Path(os.fsdecode(raw + b"/engine\xff\x1b[31m.json")).write_text(live_manifest(MINICPM_O).to_json())
    document = json.loads(live_manifest().to_json())
    document["\ud800\x1b[2J" + "k" * 5000] = 1
    Path(os.fsdecode(raw + b"/bad\xfe.json")).write_text(json.dumps(document))  # \ud800 as JSON escapes it


def test_names_and_keys_that_are_not_text_never_break_a_page(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    odd_folder(folder)
    with sidecar(tmp_path, *serve_args(folder)) as sc:
        for _ in range(2):
            s = sc.samples()
            assert manifest_states(s) == (2, 0, 1)
            assert declared_models(s) == {MODEL, MINICPM_O.model_name}
            assert pick(s, "model_local_kv_manifest_errors_total", reason="unknown_field") == 1
        status, _, body = sc.get("/")
        assert status == 200
        page = plain_text(body)
        assert "engine\\xff\\x1b[31m.json" in page and "bad\\xfe.json" in page
        assert "\\ud800\\x1b[2Jkkk" in page and "k... (4" in page  # the key, escaped and cut short
        assert sc.stop() == 0
    log = plain_text(sc.log_path.read_bytes())
    assert max(map(len, log.splitlines())) < 1000


def test_the_report_shows_such_names_escaped(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    odd_folder(folder)
    table = run_command("report", "--manifest-dir", str(folder))
    assert table.returncode == 1, table.stderr  # a manifest is invalid
    text = plain_text(table.stdout)
    assert "engine\\xff\\x1b[31m.json" not in text  # valid manifests are shown by engine, not by file
    assert "bad\\xfe.json: unknown_field:" in text and MINICPM_O.model_name in text
    as_json = run_command("report", "--json", "--manifest-dir", str(folder))
    assert as_json.returncode == 1, as_json.stderr
    document = json.loads(plain_text(as_json.stdout))
    assert sorted(Path(m["path"]).name for m in document["manifests"]) == sorted(
        ["engine\\xff\\x1b[31m.json", Path(write_manifest(tmp_path / "n", live_manifest())).name]
    )
    (invalid,) = document["invalid"]
    assert (Path(invalid["path"]).name, invalid["reason"]) == ("bad\\xfe.json", "unknown_field")
    json.dumps(document, ensure_ascii=False).encode("utf-8")  # no lone surrogate got in as a JSON escape either


def test_a_page_label_no_manifest_could_hold_is_refused(tmp_path: Path) -> None:
    write_manifest(tmp_path / "m", live_manifest())
    pages = {"/odd/metrics": vllm_page("tts\x1b[2J", 3), "/good/metrics": vllm_page(MODEL, 5)}
    with SimulatedEngine(pages) as engine:
        odd, good = engine.url_for("/odd/metrics"), engine.url_for("/good/metrics")
        args = ("--manifest-dir", str(tmp_path / "m"), "--engine-url", odd, "--engine-url", good, *SIMULATE_GPU)
        with sidecar(tmp_path, *args) as sc:
            for count in (1, 2):
                status, _, body = sc.get()
                assert status == 200
                s = parse(plain_text(body))
                assert pick(s, "model_local_kv_engine_page_errors_total", target=odd, reason="bad_label") == count
                assert pick(s, "model_local_kv_engine_page_up", target=good) == 1
                assert pick(s, "model_local_kv_running_sequences", model_name=MODEL) == 5
            status, _, body = sc.get("/")
            assert status == 200 and "U+001B" in plain_text(body)
            assert sc.stop() == 0
