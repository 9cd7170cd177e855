"""kv_exporter.sidecar.inputs.EnginePages against simulated engines: connections kept between scrapes and opened
again when an engine closed them; requests sent at `begin`; one engine deadline from `finish`, however many engines
hang and however long the caller worked in between."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kv_exporter.sidecar import simulated_engine
from kv_exporter.sidecar.engine_page import EngineKey, EngineTarget
from kv_exporter.sidecar.inputs import EnginePages
from kv_exporter.sidecar.records import PageResult
from kv_exporter.sidecar.simulated_engine import SimulatedEngine, vllm_page

TIMEOUT_S = 0.5


@pytest.fixture
def engine() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(vllm_page("m", 3)) as running:
        yield running


def reader(*engines: SimulatedEngine) -> EnginePages:
    return EnginePages([EngineTarget.parse(e.url) for e in engines], TIMEOUT_S)


def read(pages: EnginePages) -> list[PageResult]:
    results = pages.read_all()
    assert all(r.error is None and r.page is not None for r in results), [r.error for r in results]
    return results


def settle(condition: Callable[[], bool], within_s: float) -> None:
    """Poll until `condition` holds or `within_s` has passed; the caller asserts what it needs."""
    give_up = time.monotonic() + within_s
    while not condition() and time.monotonic() < give_up:
        time.sleep(0.01)


def test_one_connection_serves_every_scrape(engine: SimulatedEngine) -> None:
    pages = reader(engine)
    for _ in range(5):
        (result,) = read(pages)
        assert result.page is not None and result.page.running == {EngineKey("m", 0, 0): 3}
    pages.close()
    assert (engine.requests, engine.connections) == (5, 1)


def test_a_connection_the_engine_closed_is_opened_again_without_an_error(
    engine: SimulatedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(simulated_engine, "KEEP_ALIVE_S", 0.1)  # as uvicorn closes an idle one after 5 s
    pages = reader(engine)
    read(pages)
    settle(lambda: engine.open_connections == 0, 5)  # the engine closes the idle kept connection
    assert engine.open_connections == 0
    read(pages)
    engine.set("refused")  # a restart: every open connection closed, listening again on the same port
    engine.set("ok")
    read(pages)
    pages.close()
    assert (engine.requests, engine.connections) == (3, 3)
    assert not any(pages.errors_total.values())


def test_requests_go_out_at_begin_and_the_answers_wait_for_finish(engine: SimulatedEngine) -> None:
    pages = reader(engine)
    read(pages)
    reads = pages.begin()
    settle(lambda: engine.requests >= 2, 2)
    assert engine.requests == 2  # sent on the kept connection before anyone waits for the answer
    time.sleep(2 * TIMEOUT_S)  # the caller's own work: not the engine's time
    (result,) = pages.finish(reads)
    pages.close()
    assert result.error is None


def test_hanging_engines_cost_one_deadline_together(engine: SimulatedEngine) -> None:
    with SimulatedEngine(b"", fault="hang") as first, SimulatedEngine(b"", fault="hang") as second:
        pages = reader(first, engine, second)
        started = time.monotonic()
        results = pages.read_all()
        took = time.monotonic() - started
        pages.close()
    assert [r.error.reason if r.error else None for r in results] == ["timeout", None, "timeout"]
    assert took < TIMEOUT_S + 0.3, took
    assert [v for (_, reason), v in pages.errors_total.items() if v] == [1, 1]
