"""SIGTERM (and SIGINT) during a scrape: the sidecar stops accepting, finishes the answer it is writing, and exits 0
within a few seconds; an idle keep-alive connection does not hold it up."""

from __future__ import annotations

import http.client
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import pytest

from kv_exporter.manifest import write_manifest
from kv_exporter.sidecar.simulated_engine import SLOW_S, SimulatedEngine
from tests.support.constants import SIMULATE_GPU
from tests.support.manifests import MODEL, live_manifest
from tests.support.pages import vllm_page_with
from tests.support.scrape import parse, pick
from tests.support.sidecar import Sidecar, sidecar

ENGINE_TIMEOUT_S = 5.0  # longer than the slow engine takes: the scrape in flight will succeed


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def connect(sc: Sidecar) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(urllib.parse.urlsplit(sc.url).netloc, timeout=30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_a_scrape_finishes_it_and_exits_0(tmp_path: Path, sig: int) -> None:
    write_manifest(tmp_path / "m", live_manifest())
    args = ("--manifest-dir", str(tmp_path / "m"), "--engine-timeout", str(ENGINE_TIMEOUT_S), *SIMULATE_GPU)
    with (
        SimulatedEngine(vllm_page_with(17, MODEL)) as engine,
        sidecar(tmp_path, *args, "--engine-url", engine.url) as sc,
    ):
        idle = connect(sc)  # a keep-alive connection, idle when the signal comes
        idle.request("GET", "/healthz")
        assert idle.getresponse().read() == b"ok\n"
        engine.set("slow")
        answers: list[tuple[int, str | None, bytes]] = []

        def scrape() -> None:
            conn = connect(sc)
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            answers.append((response.status, response.getheader("Connection"), response.read()))

        scraper = threading.Thread(target=scrape)
        scraper.start()
        wait_for(lambda: engine.requests == 1)  # the scrape is in flight, waiting for the engine
        signalled = time.monotonic()
        code = sc.stop(sig)
        exited_after = time.monotonic() - signalled
        scraper.join(10)
    assert code == 0
    assert exited_after < SLOW_S + 2.0, exited_after
    [(status, connection, body)] = answers
    assert status == 200 and connection == "close"
    samples = parse(body.decode())  # the whole page, not a torn one
    assert pick(samples, "model_local_kv_running_sequences", model_name=MODEL) == 17
    with pytest.raises(OSError):
        connect(sc).request("GET", "/healthz")  # no longer listening
