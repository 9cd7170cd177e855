"""Target 4, scaling: scrape time for 10, 100, 1,000 and 10,000 declarations; a table and a PNG plot.

.venv/bin/python -m bench.bench_scaling [--sizes 10,100,1000,10000] [--plot docs/scaling.png] [--json-out F]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import generate_latest

from bench.baseline_server import build_registry, equivalent_spec, series_count, start_baseline
from bench.benchlib import Report, Scraper, Stats, Subject, children, interleaved, rss_bytes, summarize
from bench.deployment import scaling_layout, start_deployment, text_page
from tests.support.constants import REPO

# The largest: ~100,000 series (6 a declaration, with the engines', GPUs' and exporter's), issue 40's size.
SIZES = (10, 100, 1000, 10_000, 16_670)
# Each a worker of 10 declarations; the plot and the table need enough samples for a p90, not thousands.
SCRAPES = {10: 300, 100: 200, 1000: 40, 10_000: 6, 16_670: 6}
# Issue 40: CPU per series at ~100,000 series within 1.1x of at 1,000 declarations, and RSS there within 150 MiB.
PER_SERIES_RATIO = 1.1
LARGEST_RSS_MIB = 150.0
REFERENCE_SIZE = 1000
# Growth exponent k in cost ~ n^k between the two largest sizes: 1.0 is linear; n log n reads 1.13 from 1,000 to
# 10,000, quadratic 2.0. Allowed: up to 1.2 (GC and cache effects of a 10x larger working set; see the note).
MAX_EXPONENT = 1.2

METHOD = """
For each size: that many declarations in manifests of 10 (1 to 1,667 workers, dealt over 3 stages and 8 GPUs),
each worker's step record written every 10 ms, the sidecar (8 simulated GPUs) started fresh, checked to export
every declaration. Scraped over HTTP as Prometheus does (OpenMetrics, gzip), in blocks alternating with two baselines
built from the same page: (1) prometheus_client's start_http_server serving plain Gauges with exactly the same
series, same client and headers; (2) generate_latest on that plain-Gauge registry, in the client process
(encoding only: no HTTP, no gzip, no collection). Target: linear growth, read as the exponent k of cost ~ n^k between
1,000 and the largest size (1.0 linear, 1.13 for n log n over 1,000-10,000, 2.0 quadratic; allowed <= 1.2), on the
sidecar's CPU time per scrape (from /proc; wall time is shown too, but on shared cores it carries other work's load);
the CPU per series at the largest (~100,000 series) within 1.1x of at 1,000 declarations, its RSS within 150 MiB;
and there the sidecar's whole scrape no slower than (2). --max-series and --max-label-bytes are raised so that no
manifest is left out.
"""


@dataclass
class Row:
    declarations: int
    series: int
    ours: Stats
    served: Stats  # start_http_server, same series
    encode: Stats  # generate_latest alone, same series
    rss_mib: float
    cpu_ms: float  # the sidecar's CPU time per scrape


def measure(size: int, scrapes: int) -> Row:
    layout = scaling_layout(size)
    with tempfile.TemporaryDirectory() as tmp, children() as kids:
        caps = ["--max-series", str(20 * size + 1000), "--max-label-bytes", str(max(8 << 20, 2000 * size))]
        running = start_deployment(kids, layout, Path(tmp), caps)
        spec = equivalent_spec(text_page(running.port))
        registry = build_registry(spec)
        baseline_pid, baseline_port = start_baseline(kids, spec, Path(tmp))
        ours = Subject(running.sidecar.pid, Scraper("127.0.0.1", running.port, timeout_s=300))
        served = Subject(baseline_pid, Scraper("127.0.0.1", baseline_port, timeout_s=300))
        subjects = {"ours": ours, "served": served}
        interleaved(subjects, 1)  # warm-up
        for subject in subjects.values():
            subject.samples.clear()
            subject.cpu_s = 0.0
        encode: list[float] = []
        block = max(1, scrapes // 2)
        while len(ours.samples) < scrapes:
            interleaved(subjects, min(block, scrapes - len(ours.samples)), block)
            for _ in range(min(block, scrapes - len(encode))):
                started = time.perf_counter()
                generate_latest(registry)
                encode.append((time.perf_counter() - started) * 1000)
        rss = rss_bytes(running.sidecar.pid) / (1 << 20)
        for subject in subjects.values():
            subject.scraper.close()
    cpu = ours.cpu_s * 1000 / len(ours.samples)
    return Row(
        size, series_count(spec), summarize(ours.samples), summarize(served.samples), summarize(encode), rss, cpu
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--plot", default=str(REPO / "docs" / "scaling.png"), help="PNG to write ('' for none)")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    report = Report("Target 4: scaling (10 to 10,000 declarations)", METHOD)
    report.start()
    rows = []
    for size in sizes:
        row = measure(size, SCRAPES.get(size, 20))
        rows.append(row)
        report.stats(f"{size} decl: kv-exporter scrape", row.ours)
        report.stats(f"{size} decl: start_http_server scrape", row.served)
        report.stats(f"{size} decl: generate_latest only", row.encode)
        report.note(f"{size} decl: series; sidecar RSS MiB", f"{row.series}; {row.rss_mib:.1f}")
        report.note(f"{size} decl: sidecar CPU ms per scrape", f"{row.cpu_ms:.2f}")
        report.ratio(f"{size} decl: ours / generate_latest", row.ours.median, row.encode.median)
    print_table(rows)
    report.figures["table"] = [
        {"declarations": r.declarations, "series": r.series, "ours_median_ms": r.ours.median,
         "ours_p90_ms": r.ours.p90, "ours_cpu_ms": r.cpu_ms, "served_median_ms": r.served.median,
         "encode_median_ms": r.encode.median, "sidecar_rss_mib": r.rss_mib}
        for r in rows
    ]  # fmt: skip
    check(report, rows)
    if args.plot:
        plot(rows, Path(args.plot))
        report.note("plot", args.plot)
    report.finish(args.json_out)
    return 0


def exponent(small: int, small_cost: float, large: int, large_cost: float) -> float:
    """k in cost ~ n^k through two points."""
    return math.log(large_cost / small_cost) / math.log(large / small)


def check(report: Report, rows: list[Row]) -> None:
    reference = next((r for r in rows if r.declarations == REFERENCE_SIZE), None)
    if reference is not None and rows[-1].declarations > REFERENCE_SIZE:
        a, b = reference, rows[-1]
        span = f"{a.declarations:,} -> {b.declarations:,}"
        k_cpu = exponent(a.declarations, a.cpu_ms, b.declarations, b.cpu_ms)
        report.note(
            f"growth exponent {span}: wall",
            f"{exponent(a.declarations, a.ours.median, b.declarations, b.ours.median):.3f}",
        )
        report.note(
            f"growth exponent {span}: generate_latest",
            f"{exponent(a.declarations, a.encode.median, b.declarations, b.encode.median):.3f}",
        )
        report.check(f"linear growth (CPU exponent {span} <= {MAX_EXPONENT:g})", f"{k_cpu:.3f}", k_cpu <= MAX_EXPONENT)
        per_a, per_b = a.cpu_ms * 1000 / a.series, b.cpu_ms * 1000 / b.series
        report.check(
            f"CPU per series at {b.series:,} series within {PER_SERIES_RATIO:g}x of at {a.series:,}",
            f"{per_b:.3f} against {per_a:.3f} us ({per_b / per_a:.3f} x)",
            per_b <= PER_SERIES_RATIO * per_a,
        )
        report.check(
            f"RSS at {b.series:,} series <= {LARGEST_RSS_MIB:g} MiB",
            f"{b.rss_mib:.1f} MiB",
            b.rss_mib <= LARGEST_RSS_MIB,
        )
    largest = rows[-1]
    report.check(
        f"at {largest.declarations}: whole scrape no slower than generate_latest alone",
        f"{largest.ours.median:.0f} ms vs {largest.encode.median:.0f} ms",
        largest.ours.median <= largest.encode.median,
    )


def print_table(rows: list[Row]) -> None:
    print("\n  | declarations | series | kv-exporter median (p90) ms | sidecar CPU ms | start_http_server median ms | "
          "generate_latest median ms | ours / generate_latest | sidecar RSS MiB |")  # fmt: skip
    print("  | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"  | {r.declarations:,} | {r.series:,} | {r.ours.median:.1f} ({r.ours.p90:.1f}) | {r.cpu_ms:.1f} | "
            f"{r.served.median:.1f} | {r.encode.median:.1f} | {r.ours.median / r.encode.median:.2f} | {r.rss_mib:.1f} |"
        )
    print(flush=True)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.declarations for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    lines: tuple[tuple[str, list[Stats], str], ...] = (
        ("kv-exporter: whole scrape over HTTP", [r.ours for r in rows], "o-"),
        ("start_http_server, same series", [r.served for r in rows], "s--"),
        ("generate_latest only, same series", [r.encode for r in rows], "^:"),
    )
    for label, stats, style in lines:
        medians = [s.median for s in stats]
        spread = [[s.median - s.min for s in stats], [s.p90 - s.median for s in stats]]
        ax.errorbar(x, medians, yerr=spread, fmt=style, capsize=3, label=label)
    reference = rows[-1].ours.median
    ax.plot(x, [reference * n / x[-1] for n in x], color="grey", linewidth=0.8, label="linear (through 10,000)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("declarations")
    ax.set_ylabel("ms per scrape (median; bars: min to p90)")
    ax.set_title("Scrape time against declarations (2 cores, shared machine)")
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
