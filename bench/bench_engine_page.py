"""Target 2, engine-page reading: the running counts out of a real page, kv-exporter's scanner against
prometheus_client's parser on the same bytes, in the same run.

    .venv/bin/python -m bench.bench_engine_page [--repeats N] [--compare-with GITREF] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.benchlib import Report, summarize
from bench.deployment import source_at
from kv_exporter.sidecar.engine_page import PIPELINE_SERIES, STAGE_SERIES, EngineKey, EnginePage, scan_page
from tests.support.pages import OMNI_PAGE, VLLM_MODEL, vllm_page_with

FASTER_AT_LEAST = 20.0
RUNNING = 5

METHOD = f"""
Input: the recorded vLLM 0.32 page ({VLLM_MODEL}, 599 lines, ~51 KB) with running count {RUNNING}, as bytes
off the socket; also the recorded vllm-omni 0.30 page (771 lines) for reference. kv-exporter:
engine_page.scan_page(bytes). Baseline: bytes.decode() + prometheus_client.parser.text_string_to_metric_families,
keeping the {STAGE_SERIES.name.decode()} / {PIPELINE_SERIES.name.decode()} samples. Both must find the same counts.
One timing per call (perf_counter), calls alternating in blocks of 10; ratio = baseline / kv-exporter.
"""


def parser_counts(data: bytes) -> EnginePage:
    """The same answer as scan_page, through the generic parser."""
    running: dict[EngineKey, int] = {}
    pipeline: dict[str, int] = {}
    for family in text_string_to_metric_families(data.decode()):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == STAGE_SERIES.name.decode():
                engine = labels.get("engine", labels.get("replica", "0"))
                key = EngineKey(labels["model_name"], int(labels.get("stage", "0")), int(engine))
                running[key] = int(sample.value)
            elif sample.name == PIPELINE_SERIES.name.decode():
                pipeline[labels["model_name"]] = int(sample.value)
    return EnginePage(running, pipeline)


def time_us(function: Callable[[], Any], calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        function()
        samples.append((time.perf_counter() - started) * 1e6)
    return samples


Scanner = Callable[[bytes], EnginePage]


def compare(report: Report, label: str, data: bytes, repeats: int, earlier: Scanner | None = None) -> float:
    page, parsed = scan_page(data), parser_counts(data)
    # The earlier module's classes are its own: compare what they print.
    if page != parsed or not page.running or (earlier and repr(earlier(data)) != repr(page)):
        raise RuntimeError(f"{label}: the scanner read {page}, the parser {parsed}")
    report.note(f"{label}: running counts read", f"{page.running} pipeline {page.pipeline_running}")
    ours: list[float] = []
    base: list[float] = []
    before: list[float] = []
    for _ in range(max(1, repeats // 10)):  # alternate, so background load falls on both alike
        ours += time_us(lambda: scan_page(data), 10 * 20)  # 20x more: each call is that much shorter
        base += time_us(lambda: parser_counts(data), 10)
        if earlier:
            before += time_us(lambda: earlier(data), 10 * 20)
    ours_stats, base_stats = summarize(ours), summarize(base)
    report.stats(f"{label}: kv-exporter scan_page", ours_stats, "us")
    report.stats(f"{label}: prometheus_client parser", base_stats, "us")
    if before:
        report.stats(f"{label}: scan_page at the earlier commit", summarize(before), "us")
        report.ratio(f"{label}: earlier / now (medians)", summarize(before).median, ours_stats.median)
    return report.ratio(f"{label}: parser / scanner (medians)", base_stats.median, ours_stats.median)


def scanner_at(ref: str, folder: Path) -> Scanner:
    """scan_page as it was at git `ref` (engine_page.py imports only the standard library), in this layout or the one
    before kv_exporter/sidecar/."""
    package = source_at(ref, folder) / "kv_exporter"
    path = next(p for p in (package / "sidecar" / "engine_page.py", package / "engine_page.py") if p.exists())
    spec = importlib.util.spec_from_file_location(f"engine_page_at_{ref}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    scanner: Scanner = module.scan_page
    return scanner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=200, help="parser calls per page (scanner: 20x more)")
    parser.add_argument("--compare-with", metavar="GITREF", help="also time scan_page as of this commit")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    report = Report("Target 2: engine-page reading (running counts from a real page)", METHOD)
    report.start()
    with tempfile.TemporaryDirectory() as tmp:
        earlier = scanner_at(args.compare_with, Path(tmp)) if args.compare_with else None
        ratio = compare(report, "vLLM 0.32 page", vllm_page_with(RUNNING), args.repeats, earlier)
        compare(report, "vllm-omni 0.30 page", OMNI_PAGE.read_bytes(), args.repeats, earlier)
    report.check(f"scanner >= {FASTER_AT_LEAST:g}x faster than the parser", f"{ratio:.0f}x", ratio >= FASTER_AT_LEAST)
    report.finish(args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
