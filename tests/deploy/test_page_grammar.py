"""Go is the reference for what an engine page says: a real Prometheus (its text parser, model/textparse, and Go's
net/http client) and the real sidecar read the same pages, one spelling of a running-count line each, or one HTTP
framing each, from one simulated engine. Where Prometheus refuses a page the sidecar says `malformed` (or, for
framing, `bad_response`); where Prometheus reads one the sidecar reads it too, or refuses it for what a running
count cannot be (NaN, a negative) or a manifest cannot hold (a control character in a name): never as malformed.
Where both read a line, they read the same model name and the same value (the sidecar's whole requests)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.deploy.helpers import Prometheus, start_prometheus
from tests.support.scrape import Samples
from tests.support.sidecar import Sidecar, sidecar

pytestmark = pytest.mark.e2e

NAME = b"vllm:num_requests_running"
# id -> a page of one line, and whether Prometheus reads it.
NOW_MS = b"<now in ms>"  # stands for the time the page is served
LINES: dict[str, tuple[bytes, bool]] = {
    "plain": (NAME + b'{engine="0",model_name="plain"} 3', True),
    "blanks_first": (b" \t" + NAME + b'{model_name="blanks_first"} 3', False),  # they become part of the name
    "tabs_and_spaces": (NAME + b'\t{ model_name = "tabs_and_spaces" , engine="1" , }\t4', True),
    "no_comma": (NAME + b'{model_name="no_comma" stage="1"}5', True),
    "trailing_blanks": (NAME + b'{model_name="trailing_blanks"} 3  \t', True),
    "point_last": (NAME + b'{model_name="point_last"} 5.', True),
    "point_first": (NAME + b'{model_name="point_first"} .5e1', True),
    "plus": (NAME + b'{model_name="plus"} +3', True),
    "exponent": (NAME + b'{model_name="exponent"} 3E+0', True),
    "minus_zero": (NAME + b'{model_name="minus_zero"} -0', True),
    "fraction": (NAME + b'{model_name="fraction"} 2.9', True),
    "timestamp": (NAME + b'{model_name="timestamp"} 3 ' + NOW_MS, True),
    "largest_timestamp": (NAME + b'{model_name="largest_timestamp"} 3 9223372036854775807', True),
    "escapes": (NAME + b'{model_name="esc\\"a\\\\pe\\t"} 3', True),
    "inf": (NAME + b'{model_name="inf"} +Inf', True),
    "infinity": (NAME + b'{model_name="infinity"} -infinity', True),
    "nan": (NAME + b'{model_name="nan"} NaN', True),
    "negative": (NAME + b'{model_name="negative"} -1', True),
    "control_character": (NAME + b'{model_name="control\x1bcharacter"} 3', True),
    "empty_model_name": (NAME + b'{model_name=""} 3', True),
    "no_labels": (NAME + b" 3", True),
    "raw_newline": (NAME + b'{model_name="raw\nnewline"} 3', True),
    "nul": (NAME + b'{model_name="nul\x00"} 3', True),
    "repeated_label": (NAME + b'{model_name="a",model_name="b"} 3', False),
    "unicode_digit": (NAME + b'{model_name="unicode_digit",engine="\xc2\xb2"} 3', True),
    "comment": (b"# " + NAME + b" 3", True),
    "sibling": (NAME + b'_total{model_name="sibling"} 3', True),
    "underscore": (NAME + b'{model_name="underscore"} 1_000', False),
    "hex": (NAME + b'{model_name="hex"} 0x10', False),
    "hex_float": (NAME + b'{model_name="hex_float"} 0x1p4', False),
    "out_of_range": (NAME + b'{model_name="out_of_range"} 1e400', False),
    "signed_nan": (NAME + b'{model_name="signed_nan"} +nan', False),
    "word": (NAME + b'{model_name="word"} three', False),
    "junk_after": (NAME + b'{model_name="junk_after"} 3x', False),
    "crlf": (NAME + b'{model_name="crlf"} 3\r', False),
    "negative_timestamp": (NAME + b'{model_name="negative_timestamp"} 3 -5', False),
    "float_timestamp": (NAME + b'{model_name="float_timestamp"} 3 1.5', False),
    "timestamp_too_large": (NAME + b'{model_name="timestamp_too_large"} 3 9223372036854775808', False),
    "two_timestamps": (NAME + b'{model_name="two_timestamps"} 3 4 5', False),
    "no_value": (NAME + b'{model_name="no_value"}', False),
    "not_utf8": (NAME + b'{model_name="not\xffutf8"} 3', False),
    "double_comma": (NAME + b'{model_name="double_comma",,engine="0"} 3', False),
    "only_comma": (NAME + b"{,} 3", False),
    "unclosed": (NAME + b'{model_name="unclosed" 3', False),
    "bad_label_name": (NAME + b'{model-name="bad_label_name"} 3', False),
}
# HTTP framings of a good page (the simulated engine's fault modes) and whether Go's client reads them.
FRAMINGS = {"ok": True, "early_hints": True, "chunked": True, "interim_flood": False, "bad_chunk": False}
# What the sidecar may answer for a page Prometheus reads (None: read; else what no running count or manifest can
# be), and for one it refuses.
READ = (None, "bad_value", "bad_label", "missing_label", "no_running_series")
REFUSED = ("malformed", "bad_response")


def page(line: bytes) -> bytes:
    return line + b"\n"


def grammar_config(urls: dict[str, str]) -> dict[str, Any]:
    """One scrape job with a target per case, each at its own metrics path, labelled with its case."""
    targets = []
    for case, url in urls.items():
        address, path = url.removeprefix("http://").split("/", 1)
        targets.append({"targets": [address], "labels": {"__metrics_path__": f"/{path}", "case": case}})
    interval = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    return {"global": interval, "scrape_configs": [{"job_name": "grammar", "static_configs": targets}]}


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, SimulatedEngine]]:
    """One engine serving every line at its own path, and one per framing (a fault mode is per engine)."""
    now_ms = b"%d" % (time.time() * 1000)  # when served: Prometheus keeps no sample stamped over 5 min before a query
    pages = {f"/{case}/metrics": page(line.replace(NOW_MS, now_ms)) for case, (line, _) in LINES.items()}
    lines = SimulatedEngine(pages)
    framed = {mode: SimulatedEngine(page(LINES["plain"][0]), fault=mode) for mode in FRAMINGS}
    try:
        yield {"lines": lines, **framed}
    finally:
        for engine in (lines, *framed.values()):
            engine.stop()


def targets(engines: dict[str, SimulatedEngine]) -> dict[str, str]:
    """case -> the URL that serves it."""
    found = {case: engines["lines"].url_for(f"/{case}/metrics") for case in LINES}
    return found | {f"framing_{mode}": engines[mode].url for mode in FRAMINGS}


@pytest.fixture(scope="module")
def prometheus(engines: dict[str, SimulatedEngine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    urls = targets(engines)
    with start_prometheus(tmp_path_factory.mktemp("prometheus-grammar"), grammar_config(urls), {}) as running:
        running.wait_for(f'count(up{{job="grammar"}}) == {len(urls)}', 60)
        yield running


@pytest.fixture(scope="module")
def exporter(engines: dict[str, SimulatedEngine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    workdir = tmp_path_factory.mktemp("sidecar-grammar")
    urls = [arg for url in targets(engines).values() for arg in ("--engine-url", url)]
    with sidecar(workdir, "--manifest-dir", str(workdir / "m"), "--no-nvml", *urls) as running:
        yield running


def refusal(samples: Samples, url: str) -> str | None:
    """The reason the sidecar refused the page at `url` (None: read)."""
    reasons = [
        dict(ls)["reason"]
        for (name, ls), value in samples.items()
        if name == "model_local_kv_engine_page_errors_total" and value and dict(ls)["target"] == url
    ]
    assert len(reasons) <= 1, (url, reasons)  # the same fault, the same reason every time
    return reasons[0] if reasons else None


def test_the_sidecar_refuses_what_prometheus_refuses(
    prometheus: Prometheus, exporter: Sidecar, engines: dict[str, SimulatedEngine]
) -> None:
    up = {r["metric"]["case"]: r["value"][1] == "1" for r in prometheus.query('up{job="grammar"}')}
    samples = exporter.samples()
    urls = targets(engines)
    expected = {case: reads for case, (_, reads) in LINES.items()} | {f"framing_{m}": r for m, r in FRAMINGS.items()}
    assert up == expected  # the cases say what Go does: checked here, against Prometheus itself
    answers = {case: refusal(samples, url) for case, url in urls.items()}
    disagree = {case: reason for case, reason in answers.items() if reason not in (READ if up[case] else REFUSED)}
    assert disagree == {}


def test_what_both_read_they_read_alike(
    prometheus: Prometheus, exporter: Sidecar, engines: dict[str, SimulatedEngine]
) -> None:
    theirs = {
        r["metric"]["case"]: (r["metric"].get("model_name", ""), float(r["value"][1]))
        for r in prometheus.query('vllm:num_requests_running{job="grammar"}')
        if not r["metric"]["case"].startswith("framing_")
    }
    samples = exporter.samples()
    ours = {dict(ls)["model_name"]: v for (n, ls), v in samples.items() if n == "model_local_kv_running_sequences"}
    read = [case for case in LINES if refusal(samples, targets(engines)[case]) is None]
    assert {"plain", "escapes", "tabs_and_spaces", "no_comma", "fraction", "timestamp"} <= set(read), read
    stored = [case for case in read if case in theirs]  # Prometheus keeps no sample stamped far from now
    assert set(read) - set(stored) == {"largest_timestamp"}
    for case in stored:
        model_name, value = theirs[case]
        assert ours.get(model_name) == math.trunc(value), (case, model_name, value)
