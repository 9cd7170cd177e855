"""Target 5, concurrency: 32 scrapers at once for 30 s against the target-1 deployment; no errors, and a p99 within
4x the single-client p99 measured in the same run.

    .venv/bin/python -m bench.bench_concurrency [--clients N] [--seconds S] [--compare-with GITREF] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.benchlib import Report, ScrapeError, Scraper, children, cpu_seconds, summarize
from bench.deployment import SCRAPE_LAYOUT, Running, pages_served, source_at, start_deployment, start_sidecar

P99_FACTOR = 4.0

METHOD = """
The deployment of target 1 (8 GPUs x 3 stages x 6 declarations, 3 engines). First one client scraping back to
back for a third of the run time (the single-client p99), then N clients at once, each its own thread and
keep-alive connection in this process, each scraping back to back (no pause) with Prometheus' headers for the
run time. Errors: any exception, non-200 or empty body. Collections are counted at the engines (each collection
fetches every page once), so scrapes per collection shows how much concurrent scrapes share.
With --compare-with REF, the sidecar as of REF runs the same phases after ours, then the two alternate in six short
concurrent rounds (the order flipping each round) for ratios the machine's drift falls on equally.
"""


@dataclass
class Phase:
    samples: list[float] = field(default_factory=list)  # ms
    errors: list[str] = field(default_factory=list)
    collections: int = 0
    cpu_s: float = 0.0


def scrape_for(port: int, seconds: float, phase: Phase, lock: threading.Lock, start: threading.Barrier) -> None:
    scraper = Scraper("127.0.0.1", port)
    mine: list[float] = []
    errors: list[str] = []
    start.wait()
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            try:
                elapsed, body, _ = scraper.scrape()
                if not body:
                    raise ScrapeError("empty body")
                mine.append(elapsed * 1000)
            except ScrapeError as exc:
                errors.append(str(exc))
    finally:
        scraper.close()
        with lock:
            phase.samples += mine
            phase.errors += errors


def run_phase(running: Running, clients: int, seconds: float) -> Phase:
    phase = Phase()
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    threads = [
        threading.Thread(target=scrape_for, args=(running.port, seconds, phase, lock, start)) for _ in range(clients)
    ]
    for thread in threads:
        thread.start()
    served, cpu = pages_served(running), cpu_seconds(running.sidecar.pid)
    start.wait()
    for thread in threads:
        thread.join(seconds + 60)
    phase.collections = (pages_served(running) - served) // len(running.engine_ports)
    phase.cpu_s = cpu_seconds(running.sidecar.pid) - cpu
    return phase


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--compare-with", metavar="GITREF", help="also run against the sidecar as of this commit")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    report = Report(f"Target 5: concurrency ({args.clients} scrapers for {args.seconds:g} s)", METHOD)
    report.start()
    with tempfile.TemporaryDirectory() as tmp, children() as kids:
        running = start_deployment(kids, SCRAPE_LAYOUT, Path(tmp), pages=True)  # collections counted at the engines
        single, many = both_phases(running, args.clients, args.seconds)
        if args.compare_with:
            source = source_at(args.compare_with, Path(tmp))
            sidecar = start_sidecar(
                kids, SCRAPE_LAYOUT, Path(tmp), running.engines.pid, running.engine_ports, source=source
            )
            earlier = dataclasses.replace(running, sidecar=sidecar)
            show(report, f"at {args.compare_with}: ", *both_phases(earlier, args.clients, args.seconds))
            side_by_side(report, running, earlier, args.compare_with, args.clients, args.seconds)
    factor = show(report, "", single, many)
    shown = "; ".join(sorted(set(many.errors))[:3])
    report.check("no errors", f"{len(many.errors)} errors" + (f" ({shown})" if shown else ""), not many.errors)
    report.check(f"p99 within {P99_FACTOR:g}x the single-client p99", f"{factor:.2f}x", factor <= P99_FACTOR)
    report.finish(args.json_out)
    return 0


def both_phases(running: Running, clients: int, seconds: float) -> tuple[Phase, Phase]:
    run_phase(running, 1, 2)  # warm-up
    return run_phase(running, 1, seconds / 3), run_phase(running, clients, seconds)


def side_by_side(
    report: Report, ours: Running, earlier: Running, ref: str, clients: int, seconds: float, rounds: int = 6
) -> None:
    """The two sidecars' concurrent phases alternated in `rounds` short rounds (the order flipping each round), so
    that the machine's drift falls on both: CPU per scrape and scrapes per second as per-round ratios, medians."""
    cpu, rate = [], []
    for index in range(rounds):
        phases: dict[int, Phase] = {}
        for which in (0, 1) if index % 2 else (1, 0):
            phases[which] = run_phase((ours, earlier)[which], clients, seconds / rounds)
        per_scrape = [phase.cpu_s / max(1, len(phase.samples)) for phase in (phases[0], phases[1])]
        cpu.append(per_scrape[0] / per_scrape[1])
        rate.append(len(phases[0].samples) / max(1, len(phases[1].samples)))
    shown = ", ".join(f"{value:.2f}" for value in cpu)
    report.note(
        f"interleaved, {rounds} rounds: CPU per scrape (ours / {ref})", f"{statistics.median(cpu):.3f} ({shown})"
    )
    report.note(f"interleaved, {rounds} rounds: scrapes (ours / {ref})", f"{statistics.median(rate):.3f}")


def show(report: Report, prefix: str, single: Phase, many: Phase) -> float:
    """Prints one sidecar's figures; returns its p99 factor (concurrent / single)."""
    alone, together = summarize(single.samples), summarize(many.samples)
    clients = f"{prefix}concurrent"
    report.stats(f"{prefix}1 client", alone)
    report.stats(clients, together)
    report.ratio(f"{prefix}p99 (concurrent/single)", together.p99, alone.p99)
    report.ratio(f"{prefix}median (concurrent/single)", together.median, alone.median)
    for label, phase in ((f"{prefix}1 client", single), (clients, many)):
        per_collection = len(phase.samples) / max(1, phase.collections)
        report.note(
            f"{label}: scrapes, collections, errors",
            f"{len(phase.samples)}, {phase.collections} ({per_collection:.1f} per collection), {len(phase.errors)}",
        )
        report.note(f"{label}: CPU ms per scrape", f"{phase.cpu_s * 1000 / max(1, len(phase.samples)):.2f}")
    return together.p99 / alone.p99


if __name__ == "__main__":
    sys.exit(main())
