"""Engine decode throughput with observation on and off: two real vLLM 0.32 CPU servers, side by side.

    .venv/bin/python -m bench.bench_decode [--pairs N] [--waves N] [--tokens N] [--json-out FILE]

Needs .venv-vllm (`make engine-env`); takes about 6 minutes (two engine start-ups, then the blocks), so
`bench.run_all` runs it only when asked (`--engine`, or `--only decode`). A missed target is reported, not an error
(exit status 0); 2 without .venv-vllm.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.benchlib import Report, cpu_seconds, summarize
from kv_exporter.manifest import read_manifest
from kv_exporter.observation import ObservationState
from tests.engine.server import MAX_NUM_SEQS, VLLM_PYTHON, Server, group_members, start_server
from tests.engine.testplugin.kvx_testplugin import geometry as g
from tests.engine.tinymodel import build_model
from tests.support.scrape import parse, pick

INTERVALS = {"on": "1", "off": "0"}  # KV_EXPORTER_OBSERVE_INTERVAL; 1 s: the engine tests', ten times the default
ORDERS = (("on", "off"), ("off", "on"))  # the servers' start order in each phase: a server started first runs slower
SLOWDOWN_BUDGET = 0.01  # at most 1% slower with observation on
WORKER = "kvx_testplugin.worker.KvxRequestsCPUWorker"

METHOD = f"""
Two real vLLM 0.32 CPU servers (default multi-process layout: API server, engine core, worker; --enforce-eager,
fp32, max_num_seqs {MAX_NUM_SEQS}) serve the same tiny Qwen2 with the engine tests' observed architecture: three
inner modules make a real DynamicCache per request at admission and drop it when the request finishes, so the
tracker sees caches created and released throughout. One server samples every second
(KV_EXPORTER_OBSERVE_INTERVAL=1: the cache class patched, caches tracked, the sampler thread walking them), the other
has observation off (KV_EXPORTER_OBSERVE_INTERVAL=0: nothing patched, no thread). Both run at once; the idle one
sleeps (vLLM's workers wait on a socket once idle), and the blocks alternate on, off, off, on, ... so drift hits
both alike. Two phases, each with two fresh servers: the first starts "on" first, the second "off" first (two
servers both "off" differed by ~10% in a trial, the first started being the slower), half the pairs each.
A block: W waves of {MAX_NUM_SEQS} concurrent completions of T tokens (ignore_eos, short prompts): decode-bound,
{MAX_NUM_SEQS} sequences per step. Per block: generated tokens (vLLM's own vllm:generation_tokens_total) / wall
time; vLLM's mean inter-token latency (vllm:inter_token_latency_seconds sum / count over the block); CPU time per
1,000 tokens of the worker process (all its threads, the sampler's too) and of the server's whole process group
(/proc). Ratios are on / off: the ratio of the medians, and the median of each pair's ratio (the claim). And from
inside the "on" worker, the duration of its last sample at the end of each block (the manifest's duration_s): the
sampler's share of the worker's time, a figure other processes' load does not blur.
"""


@dataclass(frozen=True)
class Counters:
    tokens: float
    itl_sum: float
    itl_count: float
    worker_cpu_s: float
    server_cpu_s: float


@dataclass(frozen=True)
class Block:
    tokens_per_s: float
    itl_ms: float
    worker_cpu_ms_per_1k: float
    server_cpu_ms_per_1k: float
    sample_ms: float | None  # the worker's last sample when the block ended: its duration (None: observation off)
    sampled_caches: int


FIGURES: tuple[tuple[str, str, Callable[[Block], float]], ...] = (
    ("tokens per s", "tok/s", lambda b: b.tokens_per_s),
    ("inter-token latency", "ms", lambda b: b.itl_ms),
    ("worker CPU per 1,000 tokens", "ms", lambda b: b.worker_cpu_ms_per_1k),
    ("server CPU per 1,000 tokens", "ms", lambda b: b.server_cpu_ms_per_1k),
)


def worker_pid(server: Server) -> int:
    [path] = server.manifests()
    return read_manifest(path).process.pid


def counters(server: Server, worker: int) -> Counters:
    samples = parse(server.metrics_page())
    return Counters(
        tokens=pick(samples, "vllm:generation_tokens_total"),
        itl_sum=pick(samples, "vllm:inter_token_latency_seconds_sum"),
        itl_count=pick(samples, "vllm:inter_token_latency_seconds_count"),
        worker_cpu_s=cpu_seconds(worker),
        server_cpu_s=sum(cpu_seconds(pid) for pid in group_members(server.pid)),
    )


def block(server: Server, waves: int, tokens: int) -> Block:
    worker = worker_pid(server)
    before = counters(server, worker)
    started = time.perf_counter()
    for _ in range(waves):
        server.concurrent_completions(MAX_NUM_SEQS, tokens)
    wall = time.perf_counter() - started
    after = counters(server, worker)
    generated = after.tokens - before.tokens
    assert generated == waves * MAX_NUM_SEQS * tokens, generated
    [path] = server.manifests()
    sample = read_manifest(path).observation
    assert sample is not None
    on = sample.state is ObservationState.OK
    return Block(
        tokens_per_s=generated / wall,
        itl_ms=(after.itl_sum - before.itl_sum) / (after.itl_count - before.itl_count) * 1000,
        worker_cpu_ms_per_1k=(after.worker_cpu_s - before.worker_cpu_s) / generated * 1e6,
        server_cpu_ms_per_1k=(after.server_cpu_s - before.server_cpu_s) / generated * 1e6,
        sample_ms=sample.duration_s * 1000 if on else None,
        sampled_caches=sum(owner.caches for owner in sample.owners),
    )


def observation(server: Server) -> tuple[ObservationState, float]:
    """The worker's observation state and when its last sample was taken."""
    [path] = server.manifests()
    sample = read_manifest(path).observation
    assert sample is not None
    return sample.state, sample.taken_at


def alternate(servers: dict[str, Server], pairs: int, run: Callable[[Server], Block]) -> dict[str, list[Block]]:
    """`pairs` blocks per server, in the order a, b, b, a, a, b, ..."""
    blocks: dict[str, list[Block]] = {name: [] for name in servers}
    names = list(servers)
    for pair in range(pairs):
        for name in names if pair % 2 == 0 else reversed(names):
            blocks[name].append(run(servers[name]))
    return blocks


@dataclass(frozen=True)
class Phase:
    blocks: dict[str, list[Block]]
    sampled_s: float  # how long the "on" worker's sampler ran during the blocks


def phase(workdir: Path, model: Path, order: tuple[str, str], pairs: int, waves: int, tokens: int) -> Phase:
    """Both servers started in `order`, warmed up, then `pairs` blocks each; stopped, pass or fail."""
    servers: dict[str, Server] = {}
    try:
        for name in order:
            env = {"KV_EXPORTER_OBSERVE_INTERVAL": INTERVALS[name], "KVX_TEST_REPORT_DIR": ""}  # no held record
            servers[name] = start_server(workdir / name, model, env=env, args=["--worker-cls", WORKER])
        for server in servers.values():
            server.wait_ready()
        for server in servers.values():
            block(server, 1, tokens)  # warm-up, not counted
        first_sample = observation(servers["on"])[1]
        blocks = alternate(servers, pairs, lambda server: block(server, waves, tokens))
        states = {name: observation(server)[0] for name, server in servers.items()}
        sampled_s = observation(servers["on"])[1] - first_sample
    finally:
        for server in servers.values():
            server.stop()
    assert states == {"on": ObservationState.OK, "off": ObservationState.OFF}, states
    return Phase(blocks, sampled_s)


def measure(report: Report, pairs: int, waves: int, tokens: int) -> float:
    """The median of the per-pair throughput ratios (on / off)."""
    blocks: dict[str, list[Block]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", architecture=g.OBSERVED_ARCHITECTURE)
        for index, order in enumerate(ORDERS):
            done = phase(Path(tmp) / f"phase-{index}", model, order, pairs // len(ORDERS), waves, tokens)
            report.note(f"phase {index} (started {' then '.join(order)}): seconds sampled", round(done.sampled_s))
            for name, found in done.blocks.items():
                blocks[name].extend(found)
    for name, unit, figure in FIGURES:
        on, off = ([figure(b) for b in blocks[side]] for side in ("on", "off"))
        report.stats(f"{name}, observation on", summarize(on), unit)
        report.stats(f"{name}, observation off", summarize(off), unit)
        paired = statistics.median(a / b for a, b in zip(on, off, strict=True))
        report.note(f"{name}: on / off, medians", f"{statistics.median(on) / statistics.median(off):.4f}")
        report.note(f"{name}: on / off, median of pairs", f"{paired:.4f}")
    samples = [b.sample_ms for b in blocks["on"] if b.sample_ms is not None]
    report.stats("a sample in the engine's worker (wall)", summarize(samples))
    report.note("caches in those samples (median)", statistics.median(b.sampled_caches for b in blocks["on"]))
    share = statistics.median(samples) / 1000 / float(INTERVALS["on"])
    report.note("the sampler's share of the worker's time (median sample / interval)", f"{share:.5f}")
    return statistics.median(a.tokens_per_s / b.tokens_per_s for a, b in zip(blocks["on"], blocks["off"], strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=20, help="blocks per configuration, alternating (even)")
    parser.add_argument("--waves", type=int, default=3, help=f"waves of {MAX_NUM_SEQS} completions per block")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per completion (max-model-len is 256)")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        print("bench_decode: no .venv-vllm (run `make engine-env`)", file=sys.stderr)
        return 2
    report = Report("Engine decode throughput, observation on and off (real vLLM CPU servers)", METHOD)
    report.start()
    report.note("blocks", f"{args.pairs} per server, {args.waves} x {MAX_NUM_SEQS} completions x {args.tokens} tokens")
    ratio = measure(report, args.pairs, args.waves, args.tokens)
    report.check(
        f"decode throughput with observation on >= {1 - SLOWDOWN_BUDGET:.2f} x off (median of pairs)",
        f"{ratio:.4f} x",
        ratio >= 1 - SLOWDOWN_BUDGET,
    )
    report.finish(args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
