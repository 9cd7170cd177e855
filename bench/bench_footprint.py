"""Target 3, footprint: resident memory over 10,000 scrapes, time from process start to the first successful
scrape, and no torch (or vLLM) in the sidecar process.

    .venv/bin/python -m bench.bench_footprint [--scrapes N] [--starts N] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import compileall
import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.baseline_server import baseline_argv, equivalent_spec, start_baseline, write_spec
from bench.benchlib import (
    PYTHON,
    Children,
    Report,
    Scraper,
    children,
    mapped_files,
    rss_bytes,
    scrape_series,
    summarize,
    wait_until_serving,
)
from bench.deployment import SCRAPE_LAYOUT, start_deployment, text_page
from tests.support.constants import REPO, SIMULATE_GPU
from tests.support.net import free_port
from tests.support.node_exporter import node_exporter_argv

MIB = 1 << 20
RSS_LIMIT = 40 * MIB
STARTUP_LIMIT_S = 1.0
# Issue 40: start-up within 1.5x of what a Python user would pick instead (prometheus_client's start_http_server with
# plain gauges, the baseline), same run. node_exporter's, a Go binary's, stays a reported figure: issue 22 asked for
# 4x it, which the interpreter's own start alone exceeds (docs/benchmarks.md, open misses).
STARTUP_BASELINE_RATIO = 1.5
# Allocator noise: RSS moves in pages and arena chunks. Growth above this over the last half is a leak.
GROWTH_TOLERANCE = 256 << 10
STEP = 256 << 10  # one jump between two samples at least this big: an allocator step, not a creep
HEAVY = ("/torch/", "libtorch", "/vllm/", "/vllm_omni/", "/transformers/")
# What the started processes import from this checkout: the sidecar's package, and the baseline's helper modules.
CHECKOUT_PACKAGES = ("kv_exporter", "bench", "tests/support")

METHOD = f"""
Memory: the sidecar of target 1 (8 GPUs x 3 stages x 6 declarations, 24 workers' step records) scraped back to back
by one client; VmRSS from /proc every 100 scrapes. Growth = RSS after the last scrape minus RSS at the
halfway mark (tolerance {GROWTH_TOLERANCE >> 10} KiB for allocator granularity). Baseline: the prometheus_client
start_http_server process serving the same series, after 1,000 scrapes.
Start-up: the installed `kv-exporter serve` entry point (one simulated GPU) over the same manifests and records,
timed from Popen to the first HTTP 200 on /metrics (polled every 2 ms); baseline: the start_http_server process
the same way, and Debian's prometheus-node-exporter with its default collectors, starts interleaved. The checkout's
modules are byte-compiled first, as an installed package's are (pip compiles on install, the image at build).
Torch: every file mapped into the sidecar process after the run, checked for torch/vLLM libraries.
"""


def serve_argv(folder: Path, port: int, scripts: Path = Path(PYTHON).parent) -> list[str]:
    """The real console script, as a user runs it (the running counts from the workers' step records); `scripts`: the
    environment's bin folder."""
    script = scripts / "kv-exporter"
    argv = [str(script)] if script.exists() else [PYTHON, "-m", "kv_exporter"]
    argv += ["serve", "--manifest-dir", str(folder), *SIMULATE_GPU]
    return [*argv, "--web.listen-address", f"127.0.0.1:{port}", "--log.level", "warn"]


# The installed sidecar imports its own package, not this checkout's (which PYTHONPATH would put first).
WITHOUT_CHECKOUT = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


def installed_serve(venv: Path, folder: Path, port: int) -> list[str]:
    return serve_argv(folder, port, venv / "bin")


def compile_bytecode() -> None:
    """Byte-compile what the started processes import from this checkout, as an install does (pip on install, the image
    at build: deploy/docker/install-sidecar.sh); prometheus_client's, in the environment, already is. Where
    PYTHONDONTWRITEBYTECODE is set (as in this machine's shells) a checkout is otherwise compiled from source at every
    start: ~50 ms of the sidecar's start-up, some of the baseline's, that no installed exporter pays
    (docs/decisions/0021-start-up-measured-from-bytecode.md)."""
    for package in CHECKOUT_PACKAGES:
        compileall.compile_dir(REPO / package, quiet=1)


def time_to_first_scrape(
    kids: Children, argv_for_port: Callable[[int], list[str]], starts: int, **popen: Any
) -> list[float]:
    """Seconds from Popen to the first 200, over `starts` fresh processes (each stopped by pid); `popen`: more
    arguments for Popen (env, cwd)."""
    samples = []
    for _ in range(starts):
        port = free_port()
        argv = argv_for_port(port)
        started = time.perf_counter()
        proc = kids.start(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)
        try:
            samples.append(wait_until_serving("127.0.0.1", port, timeout_s=30) - started)
        finally:
            kids.stop(proc)
    return samples


def memory_over(pid: int, port: int, scrapes: int, every: int = 100) -> list[tuple[int, int]]:
    """(scrapes so far, RSS bytes) every `every` scrapes."""
    scraper = Scraper("127.0.0.1", port)
    points = [(0, rss_bytes(pid))]
    try:
        for done in range(every, scrapes + 1, every):
            for _ in range(every):
                scraper.scrape()
            points.append((done, rss_bytes(pid)))
    finally:
        scraper.close()
    return points


def split_growth(points: list[tuple[int, int]]) -> tuple[int, int]:
    """RSS growth as (one-off steps, steady creep). A leak creeps scrape after scrape; glibc's dynamic mmap
    threshold moves large buffers into an arena now and then, a single step that stays flat afterwards (with
    MALLOC_MMAP_THRESHOLD_ fixed the steps disappear: docs/decisions/0007-fixed-mmap-threshold.md)."""
    deltas = [b[1] - a[1] for a, b in itertools.pairwise(points)]
    steps = sum(d for d in deltas if d >= STEP)
    return steps, sum(deltas) - steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scrapes", type=int, default=10_000)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--json-out")
    parser.add_argument(
        "--installed",
        type=Path,
        metavar="VENV",
        help="also time start-up from this environment, kv-exporter installed from its wheel as the image installs it "
        "(deploy/docker/install-sidecar.sh . VENV WHEELS), against the baseline run by the same environment's Python",
    )
    args = parser.parse_args()
    report = Report("Target 3: footprint (memory over 10,000 scrapes, start-up, no torch)", METHOD)
    report.start()
    with tempfile.TemporaryDirectory() as tmp, children() as kids:
        running = start_deployment(kids, SCRAPE_LAYOUT, Path(tmp))
        spec = equivalent_spec(text_page(running.port))
        points = memory_over(running.sidecar.pid, running.port, args.scrapes)
        heavy = sorted(f for f in mapped_files(running.sidecar.pid) if any(h in f for h in HEAVY))
        baseline_pid, baseline_port = start_baseline(kids, spec, Path(tmp))
        scrape_series("127.0.0.1", baseline_port, 1000)
        baseline_rss = rss_bytes(baseline_pid)
        folder = Path(tmp) / "manifests"
        spec_file = write_spec(spec, Path(tmp))
        ours_start: list[float] = []
        base_start: list[float] = []
        node_start: list[float] = []
        installed: dict[str, list[float]] = {"ours": [], "baseline": []}
        compile_bytecode()
        for _ in range(args.starts):  # interleaved, so that load on the machine falls on all three alike
            ours_start += time_to_first_scrape(kids, lambda p: serve_argv(folder, p), 1)
            base_start += time_to_first_scrape(kids, lambda p: baseline_argv(spec_file, p), 1)
            node_start += time_to_first_scrape(kids, lambda p: node_exporter_argv(p, flags=()), 1)
            if args.installed:
                installed["ours"] += time_to_first_scrape(kids, lambda p: installed_serve(args.installed, folder, p), 1,
                                                          env=WITHOUT_CHECKOUT, cwd=folder)  # fmt: skip
                installed["baseline"] += time_to_first_scrape(
                    kids, lambda p: [str(args.installed / "bin" / "python"), *baseline_argv(spec_file, p)[1:]], 1
                )
    final, half = points[-1][1], min(points, key=lambda p: abs(p[0] - args.scrapes // 2))[1]
    growth = final - half
    report.note("RSS after start (MiB)", f"{points[0][1] / MIB:.1f}")
    report.note(f"RSS after {args.scrapes // 2} scrapes (MiB)", f"{half / MIB:.2f}")
    report.note(f"RSS after {args.scrapes} scrapes (MiB)", f"{final / MIB:.2f}")
    report.note("RSS peak during the run (MiB)", f"{max(p[1] for p in points) / MIB:.2f}")
    report.note("growth over the last half (KiB)", f"{growth / 1024:+.0f}")
    steps, creep = split_growth([p for p in points if p[0] >= args.scrapes // 2])
    report.note("  of which single steps >= 256 KiB (KiB)", f"{steps / 1024:+.0f}")
    report.note("  of which small increments (KiB)", f"{creep / 1024:+.0f}")
    report.note("baseline RSS after 1,000 scrapes (MiB)", f"{baseline_rss / MIB:.2f}")
    report.ratio("RSS (ours/baseline)", final, baseline_rss)
    ours_s, base_s = summarize([s * 1000 for s in ours_start]), summarize([s * 1000 for s in base_start])
    report.stats("start to first scrape: kv-exporter", ours_s)
    report.stats("start to first scrape: baseline", base_s)
    node_s = summarize([s * 1000 for s in node_start])
    report.stats("start to first scrape: node_exporter", node_s)
    report.ratio("start-up (ours/node_exporter, medians)", ours_s.median, node_s.median)
    if args.installed:
        inst_s, inst_base_s = (summarize([s * 1000 for s in installed[arm]]) for arm in ("ours", "baseline"))
        report.stats(f"start to first scrape: kv-exporter from {args.installed}", inst_s)
        report.stats(f"start to first scrape: baseline by {args.installed}/bin/python", inst_base_s)
        report.ratio("start-up installed (ours/baseline, medians)", inst_s.median, inst_base_s.median)
    base_ratio = ours_s.median / base_s.median
    report.check(
        f"start-up within {STARTUP_BASELINE_RATIO:g}x start_http_server's (medians)", f"{base_ratio:.2f} x",
        base_ratio <= STARTUP_BASELINE_RATIO,
    )  # fmt: skip
    report.figures["rss_points"] = points
    report.check(
        f"RSS <= {RSS_LIMIT // MIB} MiB after {args.scrapes} scrapes", f"{final / MIB:.1f} MiB", final <= RSS_LIMIT
    )
    report.check("no growth over the last half", f"{growth / 1024:+.0f} KiB", growth <= GROWTH_TOLERANCE)
    report.check(
        f"start to first scrape <= {STARTUP_LIMIT_S:g} s (slowest of {args.starts})",
        f"{ours_s.max:.0f} ms",
        ours_s.max <= STARTUP_LIMIT_S * 1000,
    )
    report.check("no torch/vLLM mapped in the sidecar", ", ".join(heavy) or "none mapped", not heavy)
    report.finish(args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
