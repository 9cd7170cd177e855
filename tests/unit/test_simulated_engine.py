"""kv_exporter.sidecar.simulated_engine: every fault reaches the sidecar's real fetch as the reason it is counted
under; a restarted engine listens on the same port again; pages are built per request and per path."""

from __future__ import annotations

import time

import pytest

from kv_exporter.sidecar.engine_page import EngineKey, EnginePageError, EngineTarget
from kv_exporter.sidecar.simulated_engine import FAULTS, HUGE_BYTES, SimulatedEngine, vllm_page
from tests.support.pages import VLLM_MODEL, VLLM_PAGE, fetch_once, read_once

TIMEOUT_S = 0.5
# fault -> the reason the sidecar counts it under (None: the page is read)
REASONS = {
    "ok": None,
    "slow": "timeout",  # with a delay past the fetch timeout
    "hang": "timeout",
    "trickle": "timeout",  # every piece in time, the whole page not
    "status_500": "http_status",
    "truncated": "truncated",
    "no_length": None,
    "huge": "too_large",
    "huge_streamed": "too_large",
    "html": "no_running_series",
    "json": "no_running_series",
    # HTTP framing: a trickle of any part costs the timeout; what Go's client refuses is refused, what it takes read.
    "trickle_status": "timeout",
    "trickle_headers": "timeout",
    "interim": "timeout",
    "interim_flood": "bad_response",  # Go's client stops after 5 interim answers
    "trickle_chunked": "timeout",
    "early_hints": None,
    "chunked": None,
    "bad_chunk": "bad_response",
    "two_lengths": "bad_response",
}


def test_every_fault_has_its_reason() -> None:
    assert set(REASONS) == set(FAULTS)


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_as_the_sidecar_reads_it(fault: str) -> None:
    with SimulatedEngine(VLLM_PAGE.read_bytes(), fault=fault, delay_s=3 * TIMEOUT_S) as engine:
        target = EngineTarget.parse(engine.url)
        started = time.monotonic()
        if REASONS[fault] is None:
            assert read_once(target, TIMEOUT_S, HUGE_BYTES).running == {EngineKey(VLLM_MODEL, 0, 0): 0}
        else:
            with pytest.raises(EnginePageError) as info:
                read_once(target, TIMEOUT_S, 4 << 20)
            assert info.value.reason == REASONS[fault]
        assert time.monotonic() - started < TIMEOUT_S + 0.5
        assert engine.requests == 1


def test_refused_then_back_on_the_same_port() -> None:
    with SimulatedEngine(VLLM_PAGE.read_bytes(), fault="hang") as engine:
        url, target = engine.url, EngineTarget.parse(engine.url)
        engine.set("refused")
        assert engine.fault == "refused"
        with pytest.raises(EnginePageError, match="unreachable"):
            fetch_once(target, TIMEOUT_S)
        engine.set("ok")
        assert engine.url == url
        assert fetch_once(target, TIMEOUT_S) == VLLM_PAGE.read_bytes()


def test_pages_per_path_built_on_each_request() -> None:
    counts = iter(range(100))
    pages = {"/a/metrics": lambda: vllm_page("a", next(counts)), "/b/metrics": vllm_page("b", 7)}
    with SimulatedEngine(pages) as engine:
        for running in (0, 1):
            page = read_once(EngineTarget.parse(engine.url_for("/a/metrics")))
            assert page.running == {EngineKey("a", 0, 0): running}
        assert read_once(EngineTarget.parse(engine.url_for("/b/metrics"))).running == {EngineKey("b", 0, 0): 7}
        with pytest.raises(EnginePageError, match="http_status"):
            fetch_once(EngineTarget.parse(engine.url_for("/nope")))
        assert engine.requests == 4


def test_an_unknown_fault_is_refused() -> None:
    with SimulatedEngine(b"") as engine, pytest.raises(ValueError, match="unknown fault"):
        engine.set("flaky")
