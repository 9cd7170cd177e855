"""Where one scrape's time goes: the benchmark deployment, the exporter in this process, pyinstrument over N
scrapes, plus a per-phase breakdown (manifests, liveness, step records, GPUs, snapshot, families, encoding, gzip),
and the HTTP split: the same server answering its page, the same server answering one constant page (its transport
alone), and the floor (`bench.floor_server`, a raw socket server) answering those bytes, scraped in alternating blocks.

    .venv/bin/python -m bench.profile_scrape [--declarations N] [--scrapes N] [--html FILE]

The stand-in workers run in their own process as in the benchmarks (stepping, each writing its step record); only
the exporter is in-process, so the profile shows its own work.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.exposition import choose_encoder

from bench.benchlib import (
    PROMETHEUS_HEADERS,
    Children,
    Scraper,
    Subject,
    children,
    format_stats,
    interleaved,
    load_average,
    summarize,
)
from bench.deployment import SCRAPE_LAYOUT, Layout, scaling_layout, start_engines, wait_for_records, write_deployment
from bench.floor_server import capture_response, start_floor
from bench.sidecar import SimulatedGpus
from kv_exporter.sidecar.app import GZIP_LEVEL, ExporterApp
from kv_exporter.sidecar.collection import Collection, CollectionSettings
from kv_exporter.sidecar.exposition import Fixed
from kv_exporter.sidecar.families import families
from kv_exporter.sidecar.inputs import assess, read_gpus
from kv_exporter.sidecar.running import engines_running
from kv_exporter.sidecar.server import build_server, serve_in_thread
from kv_exporter.sidecar.snapshot import build_snapshot
from tests.support.constants import GPU_TOTAL, GPU_USED


def phases(collection: Collection, app: ExporterApp) -> dict[str, Callable[[], Any]]:
    """The steps of one scrape, each callable on its own (each re-does its inputs' work only where cheap)."""
    loaded = collection.store.load()
    entries = assess(loaded, collection.our_namespace)
    workers = engines_running(entries, collection.records.read(entries))
    gpu = read_gpus(collection.gpu_reader, entries)
    snapshot = build_snapshot(entries, [], gpu, workers=workers)
    encoder, content_type = choose_encoder(PROMETHEUS_HEADERS["Accept"])
    metrics = families(snapshot)
    body = app.exposition.render(metrics, content_type) or b""
    return {
        "manifests (list + stat)": collection.store.load,
        "liveness (/proc)": lambda: assess(loaded, collection.our_namespace),
        "step records": lambda: engines_running(entries, collection.records.read(entries)),
        "gpus": lambda: read_gpus(collection.gpu_reader, entries),
        "snapshot": lambda: build_snapshot(entries, [], gpu, workers=workers),
        "families": lambda: families(snapshot),
        "render (kv-exporter)": lambda: app.exposition.render(metrics, content_type),
        "render (prometheus_client)": lambda: encoder(Fixed(metrics)),
        "gzip": lambda: gzip.compress(body, compresslevel=GZIP_LEVEL),
        "whole scrape (app.metrics)": lambda: app.metrics(PROMETHEUS_HEADERS["Accept"], "gzip"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--declarations", type=int, help="a scaling layout instead of the 8x3x6 one")
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--html", type=Path, help="also write pyinstrument's HTML report here")
    args = parser.parse_args()
    layout: Layout = scaling_layout(args.declarations) if args.declarations else SCRAPE_LAYOUT
    with tempfile.TemporaryDirectory() as tmp, children() as kids:
        folder = Path(tmp) / "manifests"
        engines, _ = start_engines(kids, layout.stages, steps=[folder])
        write_deployment(folder, layout, engines.pid)
        wait_for_records(folder, layout.workers)
        reader = SimulatedGpus(GPU_TOTAL, GPU_USED, layout.gpus, engines.pid)
        # The series caps raised as in bench.bench_scaling, so that every declaration is on the page.
        settings = CollectionSettings(
            manifest_dir=str(folder),
            max_series=20 * layout.declarations + 1000,
            max_label_bytes=max(8 << 20, 2000 * layout.declarations),
        )
        collection = Collection(settings, reader)
        app = ExporterApp(collection)
        print(f"{layout.declarations} declarations, {layout.workers} manifests and step records")
        for name, step in phases(collection, app).items():
            samples = []
            for _ in range(max(5, args.scrapes // 4)):
                started = time.perf_counter()
                step()
                samples.append((time.perf_counter() - started) * 1000)
            print(f"  {name:<28} {format_stats(summarize(samples))}")
        http_split(kids, app, Path(tmp), args.scrapes)
        profile(app, args.scrapes, args.html)
        collection.close()
    return 0


def http_split(kids: Children, app: ExporterApp, folder: Path, scrapes: int) -> None:
    """The scrape over HTTP against its transport alone and the floor: which part of the distance to the floor is
    the server's and which the page's making."""
    body, headers = app.metrics(PROMETHEUS_HEADERS["Accept"], "gzip")
    floor_pid, floor_port = start_floor(kids, capture_response(body, headers), folder)
    server = build_server("127.0.0.1:0", app)
    serve_in_thread(server)
    port = server.server_address[1]
    made = app.metrics

    def constant(accept: str | None, accept_encoding: str | None) -> tuple[bytes, dict[str, str]]:
        return body, headers

    arms = {"the page": made, "one constant page": constant}
    subjects = {name: Subject(os.getpid(), Scraper("127.0.0.1", port)) for name in arms}
    subjects["the floor"] = Subject(floor_pid, Scraper("127.0.0.1", floor_port))
    for _ in range(max(1, scrapes // 50)):  # the two arms of one server swap in blocks of 50
        for name, page in arms.items():
            app.metrics = page  # type: ignore[method-assign]
            interleaved({name: subjects[name]}, 50, block=50)
        interleaved({"the floor": subjects["the floor"]}, 50, block=50)
    app.metrics = made  # type: ignore[method-assign]
    server.shutdown()
    server.server_close()
    floor = statistics.median(subjects["the floor"].samples)
    print(f"over HTTP (load {load_average()}): median ms, and against the floor")
    for name, subject in subjects.items():
        median = statistics.median(subject.samples)
        print(f"  {name:<28} {median:.3f} ms  {median / floor:.1f}x")


def profile(app: ExporterApp, scrapes: int, html: Path | None) -> None:
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.0005)
    profiler.start()
    for _ in range(scrapes):
        app.metrics(PROMETHEUS_HEADERS["Accept"], "gzip")
    profiler.stop()
    print(profiler.output_text(unicode=False, color=False, show_all=False))
    if html:
        html.write_text(profiler.output_html())


if __name__ == "__main__":
    sys.exit(main())
