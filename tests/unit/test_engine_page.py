"""kv_exporter.sidecar.engine_page: the scanner on real recorded pages and on garbage; fetches from real servers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_exporter.sidecar.engine_page import (
    DEFAULT_MAX_PAGE_BYTES,
    PAGE_SERIES,
    PIPELINE_SERIES,
    STAGE_SERIES,
    EngineKey,
    EnginePageError,
    EngineTarget,
    scan_page,
)
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.support.exporter import exporter, simulated_gpu
from tests.support.net import closed_port_url
from tests.support.pages import OMNI_MODEL, OMNI_PAGE, VLLM_MODEL, VLLM_PAGE, fetch_once, read_once, vllm_page_with
from tests.support.scrape import pick

GenericKey = tuple[str, tuple[tuple[str, str], ...]]


def generic_running(data: bytes) -> dict[GenericKey, float]:
    """The same figures through prometheus_client's full parser: the reference the scanner must agree with."""
    found: dict[GenericKey, float] = {}
    for family in text_string_to_metric_families(data.decode()):
        for sample in family.samples:
            if sample.name in ("vllm:num_requests_running", "vllm_omni:num_requests_running"):
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_real_vllm_page() -> None:
    data = VLLM_PAGE.read_bytes()
    page = scan_page(data)
    assert page.running == {EngineKey(VLLM_MODEL, 0, 0): 0}
    assert page.pipeline_running == {}
    assert list(generic_running(data).values()) == [0.0]


def test_real_vllm_page_with_running_count() -> None:
    page = scan_page(vllm_page_with(17, "Qwen3-TTS"))
    assert page.running_for(EngineKey("Qwen3-TTS", 0, 0)) == 17


def test_real_vllm_omni_page_under_load_uses_the_stage_count() -> None:
    data = OMNI_PAGE.read_bytes()
    page = scan_page(data)
    # As recorded under load: 8 in flight; the per-stage gauge said 8, the lagging pipeline gauge 1.
    assert page.running == {EngineKey(OMNI_MODEL, 0, 0): 8}
    assert page.pipeline_running == {OMNI_MODEL: 1}
    assert page.running_for(EngineKey(OMNI_MODEL, 0, 0)) == 8  # the pipeline is busy: the stage count stands
    generic = generic_running(data)
    labels = (("model_name", OMNI_MODEL), ("replica", "0"), ("stage", "0"))
    assert generic[("vllm:num_requests_running", labels)] == 8
    assert generic[("vllm_omni:num_requests_running", (("model_name", OMNI_MODEL),))] == 1


OMNI_PAGES = Path(__file__).parents[1] / "omni" / "pages"


def test_stale_stage_gauge_after_load_reads_zero() -> None:
    page = scan_page((OMNI_PAGES / "vllm-omni-0.30-metrics-after-load.txt").read_bytes())
    assert page.running == {EngineKey(OMNI_MODEL, 0, 0): 8}  # stale-high, nothing is running
    assert page.running_for(EngineKey(OMNI_MODEL, 0, 0)) == 0


def test_served_model_name_page_is_gated_by_its_only_pipeline_series() -> None:
    """vllm-omni labels the pipeline gauge with the model path, the stages with the served name."""
    page = scan_page((OMNI_PAGES / "vllm-omni-0.30-metrics-served-name-2-replicas-after-load.txt").read_bytes())
    assert page.running == {EngineKey("kvx-omni-tiny", 0, 0): 4, EngineKey("kvx-omni-tiny", 0, 1): 4}
    assert page.pipeline_running == {"/tmp/tinyq": 0}
    assert page.running_for(EngineKey("kvx-omni-tiny", 0, 0)) == 0
    assert page.running_for(EngineKey("kvx-omni-tiny", 0, 1)) == 0


def test_two_pipelines_on_a_page_gate_only_their_own_model() -> None:
    page = scan_page(
        b'vllm:num_requests_running{model_name="a",replica="0",stage="0"} 5\n'
        b'vllm_omni:num_requests_running{model_name="b"} 0\n'
        b'vllm_omni:num_requests_running{model_name="c"} 0\n'
    )
    assert page.running_for(EngineKey("a", 0, 0)) == 5


def test_busy_pipeline_leaves_the_stage_count_as_read() -> None:
    page = scan_page(
        b'vllm:num_requests_running{model_name="m",replica="1",stage="2"} 3\n'
        b'vllm_omni:num_requests_running{model_name="m"} 9\n'
    )
    assert page.running_for(EngineKey("m", 2, 1)) == 3
    assert page.running_for(EngineKey("m", 0, 0)) is None


def test_escaped_labels_and_timestamps() -> None:
    page = scan_page(b'vllm:num_requests_running{model_name="a \\"b\\" \\\\ c",engine="2"} 4 1712345678000\n')
    assert page.running == {EngineKey('a "b" \\ c', 0, 2): 4}


def test_sibling_names_and_comments_are_ignored() -> None:
    page = scan_page(
        b"# HELP vllm:num_requests_running x\n"
        b'vllm:num_requests_running_total{model_name="x",engine="0"} 99\n'
        b'vllm:num_requests_running{model_name="x",engine="0"} 2\n'
    )
    assert page.running == {EngineKey("x", 0, 0): 2}


@pytest.mark.parametrize(
    ("line", "key", "count"),
    [
        (b'vllm:num_requests_running\t{ model_name = "m" , engine="2" , } 3', EngineKey("m", 0, 2), 3),
        (b'vllm:num_requests_running{model_name="m" stage="1"}4', EngineKey("m", 1, 0), 4),  # no comma, no blank
        (b'vllm:num_requests_running{model_name="m",engine=""} 5.', EngineKey("m", 0, 0), 5),  # "" is no label
        (b'vllm:num_requests_running{model_name="m\\t"} .5e1 1700000000000', EngineKey("m\\t", 0, 0), 5),
        (b'vllm:num_requests_running{model_name="m"} -0', EngineKey("m", 0, 0), 0),
        (b'vllm:num_requests_running{model_name="m\\\\n"} 2.9', EngineKey("m\\n", 0, 0), 2),
    ],
)
def test_what_prometheus_reads_is_read(line: bytes, key: EngineKey, count: int) -> None:
    """Spellings Prometheus' text parser takes (model/textparse); tests/deploy/test_page_grammar.py asks a real
    Prometheus about each."""
    assert scan_page(line + b"\n").running == {key: count}


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"<html><body>502 Bad Gateway</body></html>", "no_running_series"),
        (b"", "no_running_series"),
        (bytes(range(256)) * 100, "no_running_series"),
        (b'vllm:num_requests_running{model_name="x",engine="0" 2\n', "malformed"),
        (b'vllm:num_requests_running{model_name="x} 2\n', "malformed"),
        (b'vllm:num_requests_running{model_name="x"} two\n', "malformed"),
        (b'vllm:num_requests_running{model_name="x"} 1\r\n', "malformed"),  # CR is part of the value, as for Go
        (b' \tvllm:num_requests_running{model_name="x"} 1\n', "malformed"),  # Prometheus: part of the name
        (b'vllm:num_requests_running{model_name="x\ny"} 1\n', "bad_label"),  # Prometheus takes a raw newline
        (b'vllm:num_requests_running{model_name="x"} 1_000\n', "malformed"),
        (b'vllm:num_requests_running{model_name="x"} 0x10\n', "malformed"),
        (b'vllm:num_requests_running{model_name="x"} 1e400\n', "malformed"),  # Go: out of range
        (b'vllm:num_requests_running{model_name="x"} +nan\n', "malformed"),
        (b'vllm:num_requests_running{model_name="x"} 1 -5\n', "malformed"),
        (b'vllm:num_requests_running{model_name="x"} 1 9223372036854775808\n', "malformed"),
        (b'vllm:num_requests_running{model_name="x",,engine="0"} 1\n', "malformed"),
        (b'vllm:num_requests_running{model_name="x",engine="\xc2\xb2"} 1\n', "bad_label"),  # a Unicode digit
        (b'vllm:num_requests_running{model_name="x",engine="' + b"9" * 5000 + b'"} 1\n', "bad_label"),
        (b'vllm:num_requests_running{model_name="a\x1bb"} 1\n', "bad_label"),  # no manifest can hold it
        (b'vllm:num_requests_running{model_name="a\\nb"} 1\n', "bad_label"),
        (b'vllm:num_requests_running{model_name="' + b"x" * 257 + b'"} 1\n', "bad_label"),
        (b'vllm:num_requests_running{model_name=" "} 1\n', "bad_label"),
        (b'vllm:num_requests_running{model_name=""} 1\n', "missing_label"),
        (b'vllm:num_requests_running{model_name="x"} Infinity\n', "bad_value"),
        (b'vllm:num_requests_running{model_name="x"}\n', "malformed"),
        (b'vllm:num_requests_running{model_name="\xff"} 1\n', "malformed"),
        (b'vllm:num_requests_running{model_name="x"} NaN\n', "bad_value"),
        (b'vllm:num_requests_running{model_name="x"} -1\n', "bad_value"),
        (b'vllm:num_requests_running{model_name="x"} +Inf\n', "bad_value"),
        (b'vllm:num_requests_running{engine="0"} 1\n', "missing_label"),
        (b'vllm:num_requests_running{model_name="x",stage="a"} 1\n', "bad_label"),
        (b'vllm:num_requests_running{model_name="x",model_name="y"} 1\n', "malformed"),
        (
            b'vllm:num_requests_running{model_name="x",engine="0"} 1\n'
            b'vllm:num_requests_running{engine="0",model_name="x"} 2\n',
            "duplicate_series",
        ),
    ],
)
def test_garbage_gives_a_typed_error(data: bytes, reason: str) -> None:
    with pytest.raises(EnginePageError) as info:
        scan_page(data)
    assert info.value.reason == reason


def test_target_parsing() -> None:
    t = EngineTarget.parse("http://user:p%40ss@127.0.0.1:8000")
    assert t.url == t.target == "http://127.0.0.1:8000/metrics"
    assert t.authorization == "Basic dXNlcjpwQHNz"  # user:p@ss
    custom = EngineTarget.parse("localhost:9/custom?x=1")
    assert (custom.url, custom.target) == ("http://localhost:9/custom?x=1", "http://localhost:9/custom")
    assert EngineTarget.parse("http://[::1]:8000/metrics").target == "http://[::1]:8000/metrics"
    with pytest.raises(ValueError):
        EngineTarget.parse("ftp://host/metrics")


def test_the_target_label_has_no_userinfo_query_or_fragment(tmp_path: Path) -> None:
    """Today's main kept the query string in the label, so a `?token=` ended up in Prometheus."""
    with SimulatedEngine(VLLM_PAGE.read_bytes()) as engine:
        url = engine.url.replace("http://", "http://kv:secret@") + "?token=hunter2#frag"
        with exporter(tmp_path, [url], simulated_gpu()) as e:
            s = e.samples()
        targets = {dict(labels)["target"] for _, labels in s if "target" in dict(labels)}
        assert targets == {engine.url}
        assert pick(s, "model_local_kv_engine_page_up", target=engine.url) == 1
        assert engine.authorization == "Basic a3Y6c2VjcmV0"  # the credentials are still sent


def test_fetch_real_page_over_http() -> None:
    body = VLLM_PAGE.read_bytes()
    with SimulatedEngine(body) as engine:
        assert fetch_once(EngineTarget.parse(engine.url)) == body
        assert read_once(EngineTarget.parse(engine.url)).running == {EngineKey(VLLM_MODEL, 0, 0): 0}
        assert engine.requests == 2


def test_credentials_are_sent_but_never_in_the_target() -> None:
    with SimulatedEngine(VLLM_PAGE.read_bytes()) as engine:
        url = engine.url.replace("http://", "http://kv:secret@")
        target = EngineTarget.parse(url)
        read_once(target)
        assert "secret" not in target.target
        assert (engine.requests, engine.authorization) == (1, "Basic a3Y6c2VjcmV0")


def test_http_error_status() -> None:
    with (
        SimulatedEngine(VLLM_PAGE.read_bytes(), fault="status_500") as engine,
        pytest.raises(EnginePageError, match="http_status"),
    ):
        fetch_once(EngineTarget.parse(engine.url))


def test_engine_down() -> None:
    with pytest.raises(EnginePageError) as info:
        fetch_once(EngineTarget.parse(closed_port_url()))
    assert info.value.reason == "unreachable"


def test_slow_engine_times_out() -> None:
    with SimulatedEngine(VLLM_PAGE.read_bytes(), fault="slow", delay_s=2.0) as engine:
        started = time.monotonic()
        with pytest.raises(EnginePageError) as info:
            fetch_once(EngineTarget.parse(engine.url), timeout_s=0.3)
        assert info.value.reason == "timeout"
        assert time.monotonic() - started < 1.0


def test_trickling_engine_is_cut_off_at_the_total_deadline() -> None:
    # Each chunk arrives well within the timeout, but the whole page would take ~6 s.
    with SimulatedEngine(VLLM_PAGE.read_bytes(), fault="trickle") as engine:
        started = time.monotonic()
        with pytest.raises(EnginePageError) as info:
            fetch_once(EngineTarget.parse(engine.url), timeout_s=0.5)
        assert info.value.reason == "timeout"
        assert time.monotonic() - started < 1.2


@pytest.mark.parametrize("send_length", [True, False])
def test_huge_page_is_refused(send_length: bool) -> None:
    body = VLLM_PAGE.read_bytes() * 40  # ~2 MB
    with SimulatedEngine(body, fault="ok" if send_length else "no_length") as engine:
        with pytest.raises(EnginePageError) as info:
            fetch_once(EngineTarget.parse(engine.url), max_bytes=len(body) // 2)
        assert info.value.reason == "too_large"
        assert len(fetch_once(EngineTarget.parse(engine.url), max_bytes=len(body))) == len(body)


def test_scanning_a_large_page_is_bounded_by_the_engine_deadline() -> None:
    """A 3.5 MiB page of running series took 2-4 s to scan past --engine-timeout on today's main."""
    line = 'vllm:num_requests_running{engine="%d",model_name="%s"} 1.0\n'
    body = "".join(line % (i, "m" * 40) for i in range(37_000)).encode()
    assert 3.4 * (1 << 20) < len(body) < DEFAULT_MAX_PAGE_BYTES
    with SimulatedEngine(body) as engine:
        started = time.monotonic()
        with pytest.raises(EnginePageError) as info:
            read_once(EngineTarget.parse(engine.url), timeout_s=0.3)
        took = time.monotonic() - started
    assert info.value.reason == "timeout" and "series" in info.value.detail
    assert took < 0.3 + 0.25, took
    assert len(scan_page(body).running) == 37_000  # without a deadline, all of it


def test_the_page_series_table_names_what_real_pages_print() -> None:
    """The scanner's two series, as its table spells them, are families the recorded real servers printed; each is
    read from a page holding it alone."""
    printed = {
        family.name for page in (VLLM_PAGE, OMNI_PAGE) for family in text_string_to_metric_families(page.read_text())
    }
    assert {series.name.decode() for series in PAGE_SERIES} <= printed
    page = scan_page(f'{PIPELINE_SERIES.name.decode()}{{model_name="m"}} 0\n'.encode())
    assert page.pipeline_running == {"m": 0} and page.running == {}
    page = scan_page(f'{STAGE_SERIES.name.decode()}{{model_name="m",stage="1",replica="2"}} 3\n'.encode())
    assert page.running == {EngineKey("m", 1, 2): 3}
