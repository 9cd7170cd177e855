"""Every benchmark in turn (`make bench`), then one table: target, measured, PASS or MISS.

    .venv/bin/python -m bench.run_all [--quick] [--engine] [--only scrape,footprint,...] [--out DIR] [--strict]

from the repository root, as every benchmark module. Each benchmark is a standalone module that prints its method,
its figures (median, p90, p99, min-max) and the ratio against its baseline measured in the same run; this runner
streams that output, collects each module's checks (`--json-out`) and prints the summary. A miss is a finding, not
a failure: the exit status is 0 when every benchmark ran (1 with --strict when a target was missed), 2 when one
could not run. The decode benchmarks each start real vLLM engines (.venv-vllm) and take about 10 minutes: they run
with --engine, or when --only names them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.benchlib import Check, Report, Stats, load_average, module_argv
from tests.support.constants import REPO


@dataclass(frozen=True)
class Bench:
    key: str
    module: str  # bench.MODULE
    quick: tuple[str, ...]  # arguments for --quick (a smoke run: same code paths, fewer samples)
    engine: bool = False  # starts real vLLM engines: only with --engine, or when --only names it
    args: tuple[str, ...] = ()  # always passed


BENCHES = (
    Bench("scrape", "bench_scrape", ("--scrapes", "200")),
    Bench("engine_page", "bench_engine_page", ("--repeats", "20")),
    Bench("footprint", "bench_footprint", ("--scrapes", "1000", "--starts", "2")),
    Bench("scaling", "bench_scaling", ("--sizes", "10,100,1000", "--plot", "")),
    Bench("concurrency", "bench_concurrency", ("--seconds", "9")),
    Bench("hook", "bench_hook", ("--repeats", "10")),  # the hook helper's; optional
    Bench("observe", "bench_observe", ("--repeats", "5", "--creations", "5000")),
    # One server, adjacent steps with the observation's hooks on and off (the claim); then both arms alike, the
    # resolution of that line; then blocks pausing and resuming the observation, end to end.
    Bench("decode", "bench_decode", ("--waves", "10"), engine=True, args=("--per-step",)),
    Bench("decode_control", "bench_decode", ("--waves", "10"), engine=True, args=("--per-step", "--control")),
    Bench("decode_blocks", "bench_decode", ("--pairs", "4", "--most", "8"), engine=True, args=("--same-server",)),
    # Two servers, one with observation off from the start (nothing patched): what a fresh pair differs by is larger.
    Bench("decode_two_servers", "bench_decode", ("--pairs", "4", "--most", "8"), engine=True),
)


@dataclass
class Outcome:
    bench: Bench
    seconds: float
    checks: list[Check]
    error: str | None = None


def run(bench: Bench, quick: bool, out: Path) -> Outcome:
    extra = [*bench.args, *(bench.quick if quick else ())]
    started = time.monotonic()
    if bench.key == "hook":
        return run_hook(bench, extra, started)
    result_file = out / f"{bench.key}.json"
    result_file.unlink(missing_ok=True)
    proc = subprocess.run(module_argv(bench.module, *extra, "--json-out", str(result_file)), cwd=REPO)
    seconds = time.monotonic() - started
    if proc.returncode != 0 or not result_file.exists():
        return Outcome(bench, seconds, [], f"exit status {proc.returncode}")
    checks = [Check(**c) for c in json.loads(result_file.read_text())["checks"]]
    return Outcome(bench, seconds, checks)


def run_hook(bench: Bench, extra: list[str], started: float) -> Outcome:
    """bench.bench_hook prints JSON with --json; shown here in the same form as the others."""
    proc = subprocess.run(module_argv(bench.module, *extra, "--json"), cwd=REPO, capture_output=True, text=True)
    seconds = time.monotonic() - started
    try:
        result: dict[str, Any] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        print(proc.stdout + proc.stderr)
        return Outcome(bench, seconds, [], f"exit status {proc.returncode}, no JSON result")
    return Outcome(bench, seconds, hook_report(result).checks)


def hook_report(result: dict[str, Any]) -> Report:
    method = (
        f"bench.bench_hook (the hook's own benchmark): a {result['modules']}-module tree with "
        f"{result['declarations']} declarations, {result['repeats']} repeats, collector {result['collector']}.\n"
        "Baseline: a bare named_modules() walk of the same tree, same run."
    )
    report = Report("Target 6: hook (collection + publish on a 10,000-module tree)", method)
    report.start()
    for name, stats in result["ms"].items():
        report.stats(
            name, Stats(result["repeats"], stats["median"], stats["p90"], stats["p99"], stats["min"], stats["max"])
        )
    report.ratio("publish / bare walk (medians)", result["publish_over_walk"], 1.0)
    publish = result["ms"]["publish"]["median"]
    report.check(
        f"collection + publish <= {result['budget_ms']:g} ms", f"{publish:.1f} ms", bool(result["within_budget"])
    )
    for key, value in result.items():  # the per-step check, however bench.bench_hook names it
        if "step" in key and isinstance(value, bool):
            report.check("no wrapper on the per-step path", f"{key}: {value}", value)
    return report


def summary(outcomes: list[Outcome]) -> None:
    print("\n== Summary (figures are noisy on 2 shared cores; ratios carry the claims) ==")
    print(f"  load average now: {load_average()}")
    print(f"  {'benchmark':<12} {'target':<62} {'measured':<26} result")
    for outcome in outcomes:
        if outcome.error:
            print(f"  {outcome.bench.key:<12} {'(did not run)':<62} {outcome.error:<26} ERROR")
        for check in outcome.checks:
            verdict = "PASS" if check.ok else "MISS"
            print(f"  {outcome.bench.key:<12} {check.target:<62} {check.measured[:26]:<26} {verdict}")
    total = sum(o.seconds for o in outcomes)
    print("  time: " + ", ".join(f"{o.bench.key} {o.seconds:.0f} s" for o in outcomes) + f"; total {total:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer samples, no plot")
    parser.add_argument("--only", help="comma-separated: " + ",".join(b.key for b in BENCHES))
    parser.add_argument("--out", type=Path, default=REPO / ".artifacts" / "bench", help="result JSON files")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--engine", action="store_true", help="also the benchmarks that start real vLLM engines")
    args = parser.parse_args()
    if args.only:
        chosen = [b for b in BENCHES if b.key in args.only.split(",")]
    else:
        chosen = [b for b in BENCHES if args.engine or not b.engine]
    if not (REPO / "bench" / "bench_hook.py").exists():
        chosen = [b for b in chosen if b.key != "hook"]
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes = [run(bench, args.quick, args.out) for bench in chosen]
    summary(outcomes)
    if any(o.error for o in outcomes):
        return 2
    return 1 if args.strict and any(not c.ok for o in outcomes for c in o.checks) else 0


if __name__ == "__main__":
    sys.exit(main())
