"""Load: 50 concurrent scrapers (keep-alive connections, as Prometheus holds them) against the real sidecar process
for 60 s: no error, every page whole, and resident memory growing by less than 5 MiB.

KVX_LOAD_SECONDS shortens or lengthens the run (default 60, as issue 7 asks)."""

from __future__ import annotations

import http.client
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from kv_exporter.manifest import write_manifest
from kv_exporter.reference import MIMO_AUDIO, REFERENCE_MODELS
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.support.constants import SIMULATE_GPU
from tests.support.manifests import MODEL, live_manifest
from tests.support.pages import vllm_page_with
from tests.support.sidecar import Sidecar, sidecar

SCRAPERS = 50
SECONDS = float(os.environ.get("KVX_LOAD_SECONDS", "60"))
WARM_UP_S = 5.0  # thread stacks, allocator arenas and caches fill up first; growth is measured after
MAX_GROWTH_KIB = 5 * 1024


@dataclass
class Tally:
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def last_help_line(page: bytes) -> bytes:
    """The HELP line of a page's last family: a page cut short ends before it, or without its samples' newline."""
    return page[page.rindex(b"# HELP ") :].split(b"\n", 1)[0]


def scrape_until(sc: Sidecar, deadline: float, tally: Tally, last_help: bytes) -> None:
    netloc = urllib.parse.urlsplit(sc.url).netloc
    conn = http.client.HTTPConnection(netloc, timeout=30)
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            body = response.read()
            whole = response.status == 200 and b"# HELP " in body and last_help_line(body) == last_help
            whole = whole and body.endswith(b"\n")
            error = None if whole else f"HTTP {response.status}, {len(body)} bytes"
        except (OSError, http.client.HTTPException) as exc:
            error = f"{type(exc).__name__}: {exc}"
            conn.close()
            conn = http.client.HTTPConnection(netloc, timeout=30)
        with tally.lock:
            if error:
                tally.errors.append(error)
            else:
                tally.ok += 1
                tally.latencies.append(time.monotonic() - started)
    conn.close()


def run_scrapers(sc: Sidecar, seconds: float) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds
    last_help = last_help_line(sc.text().encode())  # from a scrape alone
    threads = [threading.Thread(target=scrape_until, args=(sc, deadline, tally, last_help)) for _ in range(SCRAPERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    assert not any(t.is_alive() for t in threads)
    return tally


def test_fifty_scrapers_for_a_minute(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    for model in REFERENCE_MODELS:
        write_manifest(folder, live_manifest(model))
    with (
        SimulatedEngine(vllm_page_with(17, MODEL)) as qwen,
        SimulatedEngine(vllm_page_with(3, MIMO_AUDIO.model_name)) as mimo,
    ):
        # 50 at once is past --web.max-requests' default (node_exporter's 40): no limit here, the load is the test.
        args = ("--manifest-dir", str(folder), "--engine-url", qwen.url, "--engine-url", mimo.url, *SIMULATE_GPU,
                "--web.max-requests", "0")  # fmt: skip
        with sidecar(tmp_path, *args) as sc:
            idle_kib = sc.rss_kib()
            warm = run_scrapers(sc, WARM_UP_S)
            before_kib = sc.rss_kib()
            tally = run_scrapers(sc, SECONDS)
            after_kib = sc.rss_kib()
            assert sc.stop() == 0
        fetches = qwen.requests + mimo.requests  # concurrent scrapes share one collection: far fewer fetches
    assert warm.errors == [] and tally.errors == [], (warm.errors[:5], tally.errors[:5])
    latencies = sorted(tally.latencies)
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    print(
        f"\n{SCRAPERS} scrapers x {SECONDS:g} s: {tally.ok} scrapes ({tally.ok / SECONDS:.0f}/s), 0 errors, "
        f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms; {fetches} engine page fetches; "
        f"RSS idle {idle_kib / 1024:.1f} MiB, after warm-up {before_kib / 1024:.1f} MiB, "
        f"after {after_kib / 1024:.1f} MiB (+{(after_kib - before_kib) / 1024:.2f} MiB)"
    )
    assert tally.ok > SCRAPERS * SECONDS / 10  # it kept serving (measured: ~2,000 a second)
    assert fetches < tally.ok + warm.ok
    assert after_kib - before_kib < MAX_GROWTH_KIB, (before_kib, after_kib)
