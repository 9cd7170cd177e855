"""Engine decode throughput with observation on and off: two real vLLM 0.32 CPU servers side by side, one server
whose worker pauses and resumes its observation between blocks (--same-server), or one server whose worker runs its
steps in adjacent pairs, one with the observation's hooks on and one off, and times them (--per-step).

    .venv/bin/python -m bench.bench_decode [--same-server | --per-step] [--control] [--interval S] [--pairs N]
        [--waves N] [--tokens N] [--json-out FILE]

The per-step comparison is the claim: one process, and adjacent steps compared, so neither what tells two fresh
servers apart nor the machine's drift between blocks can enter it; the same-server blocks give the end-to-end
figures beside it.
Needs .venv-vllm (`make engine-env`); takes about 9 minutes at the default 96 pairs (more with two servers), so
`bench.run_all` runs it only when asked (`--engine`, or `--only decode`). A missed target is reported, not an error
(exit status 0); 2 without .venv-vllm.
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import operator
import os
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

# KV_EXPORTER_OBSERVE_INTERVAL of the "on" arm unless --interval says otherwise: 1 s, the engine tests', ten times
# the default. With --same-server a resumed sampler waits one interval before its first sample: blocks must be longer
# than the interval for the "on" ones to sample (the report counts those that did).
ON_INTERVAL = "1"
# --control: both servers with observation off, so the ratio shows what two identical servers differ by here.
CONTROL_INTERVALS = {"on": "0", "off": "0"}
ORDERS = (("on", "off"), ("off", "on"))  # the servers' start order in each phase: a server started first runs slower
# --same-server: the worker's observation in each arm (the test worker's kvx_observation, through /collective_rpc)
SAME_SERVER_STATES = {"on": "running", "off": "paused"}
CONTROL_STATES = {"on": "running", "off": "running"}
SLOWDOWN_BUDGET = 0.01  # at most 1% slower with observation on
RECORD_BUDGET_NS = 300  # issue 40: the step record, a few hundred nanoseconds a step at most
# A pair counts when other processes' load differed by at most this between its two blocks (this machine is shared).
FOREIGN_DIFFERENCE_CORES = 0.1
WORKER = "kvx_testplugin.worker.KvxRequestsCPUWorker"

METHOD = f"""
Two real vLLM 0.32 CPU servers (default multi-process layout: API server, engine core, worker; --enforce-eager,
fp32, max_num_seqs {MAX_NUM_SEQS}) serve the same tiny Qwen2 with the engine tests' observed architecture: three
inner modules make a real DynamicCache per request at admission and drop it when the request finishes, so the
tracker sees caches created and released throughout, and a fourth makes per-request caches, their concatenation
and a deep copy inside every step, so every step pays the high-water mark's accounting. One server samples every
--interval seconds (default 1, ten times the default rate: the cache class patched, caches tracked, the sampler
thread walking them), the other has observation off (KV_EXPORTER_OBSERVE_INTERVAL=0: nothing patched, no
thread). Both run at once; the idle one sleeps (vLLM's workers wait on a socket once idle).
Blocks alternate in pairs, on, off, off, on, ...: a block is W waves of one completion request of
{MAX_NUM_SEQS} prompts, T tokens each (ignore_eos, short prompts), decode-bound with
{MAX_NUM_SEQS} sequences per step from the first (as {MAX_NUM_SEQS} separate requests from client threads, the
requests often reached a server that kept both cores busy one by one, and blocks ran 1 to 8 sequences a step:
575 to 3,976 tokens/s). Two phases, each with two fresh servers: the first starts "on" first, the second
"off" first (two servers both "off" differed by ~10% in a trial, the first started being the slower).
This machine is shared: during each block, the CPU other processes used (/proc/stat, steal included, less both
servers' process groups and this client) is measured, and a pair counts only where that load differed by at most
{FOREIGN_DIFFERENCE_CORES} cores between its two blocks; pairs run until enough count.
Per block: generated tokens (vLLM's own vllm:generation_tokens_total) / wall time, end to end (HTTP, prefill and
all); the engine's decode rate per sequence, 1 / its mean inter-token latency (vllm:inter_token_latency_seconds
sum / count), the claim; CPU time per 1,000 tokens of the worker process (all its threads, the sampler's too) and
of the server's process group. Ratios are on / off: of the medians, and the median of the pairs' ratios with a 95%
interval of that median (order statistics). And from inside the "on" worker, the duration of its last sample at the
end of each block (the manifest's duration_s): the sampler's share of the worker's time, which other processes
cannot blur.
"""

SAME_SERVER_METHOD = f"""
--same-server: one such server, observation on (every --interval seconds), whose test worker pauses and
resumes it between blocks through vLLM's dev-mode /collective_rpc (VLLM_SERVER_DEV_MODE=1): "off" blocks run with
the sampler thread stopped and new caches untracked (the cache class keeps its patched __new__, which then tracks
nowhere: the only difference left from observation off), "on" blocks with both back. One process, so the ~10%
by which two fresh servers differ here (the two-server control) cannot enter; pairs alternate on, off, off, on, and
count as above ({FOREIGN_DIFFERENCE_CORES} cores). --control: both arms "running".
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
    # The duration of the worker's last sample if it was taken during the block (None: observation off or paused,
    # or a resumed sampler that had not reached its first interval yet)
    sample_ms: float | None
    sampled_caches: int
    foreign_cores: float  # CPU other processes used meanwhile (neither server nor this client), in cores


@dataclass(frozen=True)
class Pair:
    on: Block
    off: Block

    @property
    def comparable(self) -> bool:
        """Other processes loaded the machine alike during both blocks: their load cancels in the ratio."""
        return abs(self.on.foreign_cores - self.off.foreign_cores) <= FOREIGN_DIFFERENCE_CORES


DECODE_RATE = "decode rate per sequence (1 / inter-token latency)"
FIGURES: tuple[tuple[str, str, Callable[[Block], float]], ...] = (
    ("tokens per s, end to end", "tok/s", lambda b: b.tokens_per_s),
    (DECODE_RATE, "tok/s", lambda b: 1000 / b.itl_ms),
    ("worker CPU per 1,000 tokens", "ms", lambda b: b.worker_cpu_ms_per_1k),
    ("server CPU per 1,000 tokens", "ms", lambda b: b.server_cpu_ms_per_1k),
)


class Machine:
    """CPU time used on the whole machine (/proc/stat, steal included) and by our processes: the rest is others'."""

    def __init__(self, servers: dict[str, Server]) -> None:
        self._servers = {server.pid: server for server in servers.values()}  # one server may serve both arms
        self._tick = os.sysconf("SC_CLK_TCK")

    def foreign_cpu_s(self) -> float:
        with open("/proc/stat") as stat:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
        busy = (user + nice + system + irq + softirq + steal) / self._tick
        ours = cpu_seconds(os.getpid()) + sum(
            cpu_seconds(pid) for server in self._servers.values() for pid in group_members(server.pid)
        )
        return busy - ours


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


def block(server: Server, machine: Machine, waves: int, tokens: int) -> Block:
    worker = worker_pid(server)
    before = counters(server, worker)
    foreign = machine.foreign_cpu_s()
    began, started = time.time(), time.perf_counter()
    for _ in range(waves):
        server.batched_completion(MAX_NUM_SEQS, tokens)
    wall = time.perf_counter() - started
    foreign = machine.foreign_cpu_s() - foreign
    after = counters(server, worker)
    generated = after.tokens - before.tokens
    assert generated == waves * MAX_NUM_SEQS * tokens, generated
    [path] = server.manifests()
    sample = read_manifest(path).observation
    assert sample is not None
    fresh = sample.state is ObservationState.OK and sample.taken_at >= began
    return Block(
        tokens_per_s=generated / wall,
        itl_ms=(after.itl_sum - before.itl_sum) / (after.itl_count - before.itl_count) * 1000,
        worker_cpu_ms_per_1k=(after.worker_cpu_s - before.worker_cpu_s) / generated * 1e6,
        server_cpu_ms_per_1k=(after.server_cpu_s - before.server_cpu_s) / generated * 1e6,
        sample_ms=sample.duration_s * 1000 if fresh else None,
        sampled_caches=sum(owner.caches for owner in sample.owners),
        foreign_cores=foreign / wall,
    )


def observation(server: Server) -> tuple[ObservationState, float]:
    """The worker's observation state and when its last sample was taken."""
    [path] = server.manifests()
    sample = read_manifest(path).observation
    assert sample is not None
    return sample.state, sample.taken_at


def alternate(comparable: int, most: int, run: Callable[[str], Block]) -> list[Pair]:
    """Pairs of blocks (`run` of "on" and "off") in the order on, off, off, on, ... until `comparable` of them are,
    or `most` were run."""
    pairs: list[Pair] = []
    while len(pairs) < most and sum(pair.comparable for pair in pairs) < comparable:
        order = ("on", "off") if len(pairs) % 2 == 0 else ("off", "on")
        blocks = {name: run(name) for name in order}
        pairs.append(Pair(blocks["on"], blocks["off"]))
    return pairs


def start(workdir: Path, model: Path, interval: str, **env: str) -> Server:
    """A server of the observed architecture sampling every `interval` seconds (0: observation off)."""
    env = {"KV_EXPORTER_OBSERVE_INTERVAL": interval, "KVX_TEST_REPORT_DIR": "", **env}  # no held record
    return start_server(workdir, model, env=env, args=["--worker-cls", WORKER])


@dataclass(frozen=True)
class Phase:
    pairs: list[Pair]
    sampled_s: float  # how long the "on" worker's sampler ran during the blocks


def phase(
    workdir: Path,
    model: Path,
    order: tuple[str, str],
    pairs: tuple[int, int],
    block_size: tuple[int, int],
    intervals: dict[str, str],
) -> Phase:
    """Both servers started in `order`, warmed up, then pairs of blocks (`alternate`); stopped, pass or fail."""
    waves, tokens = block_size
    servers: dict[str, Server] = {}
    try:
        for name in order:
            servers[name] = start(workdir / name, model, intervals[name])
        for server in servers.values():
            server.wait_ready()
        machine = Machine(servers)
        for server in servers.values():
            block(server, machine, 1, tokens)  # warm-up, not counted
        first_sample = observation(servers["on"])[1]
        found = alternate(*pairs, lambda name: block(servers[name], machine, waves, tokens))
        states = {name: observation(server)[0] for name, server in servers.items()}
        sampled_s = observation(servers["on"])[1] - first_sample
    finally:
        for server in servers.values():
            server.stop()
    expected = {name: ObservationState.OFF if s == "0" else ObservationState.OK for name, s in intervals.items()}
    assert states == expected, states
    return Phase(found, sampled_s)


def same_server_phase(
    workdir: Path,
    model: Path,
    pairs: tuple[int, int],
    block_size: tuple[int, int],
    states: dict[str, str],
    interval: str,
) -> Phase:
    """One server, observation on; before each block its worker is set to that arm's state; stopped, pass or fail."""
    waves, tokens = block_size
    server = start(workdir, model, interval, VLLM_SERVER_DEV_MODE="1")  # /collective_rpc
    try:
        server.wait_ready()
        machine = Machine({"on": server})
        block(server, machine, 1, tokens)  # warm-up, not counted
        first_sample = observation(server)[1]

        def run(name: str) -> Block:
            assert server.collective_rpc("kvx_observation", states[name]) == [states[name]]
            return block(server, machine, waves, tokens)

        found = alternate(*pairs, run)
        assert server.collective_rpc("kvx_observation", "running") == ["running"]
        time.sleep(float(interval) * 2)  # a sample after the last resume: the sampler really runs again
        state, last_sample = observation(server)
    finally:
        server.stop()
    assert state is ObservationState.OK, state
    return Phase(found, last_sample - first_sample)


def measure(
    report: Report,
    comparable: int,
    most: int,
    block_size: tuple[int, int],
    control: bool,
    same_server: bool,
    interval: str,
) -> float:
    """The median of the comparable pairs' decode-rate ratios (on / off)."""
    pairs: list[Pair] = []
    intervals = CONTROL_INTERVALS if control else {"on": interval, "off": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = build_model(workdir / "model", architecture=g.OBSERVED_ARCHITECTURE)
        phases: list[tuple[str, Callable[[], Phase]]]
        if same_server:
            states = CONTROL_STATES if control else SAME_SERVER_STATES
            run_one = functools.partial(same_server_phase, workdir / "phase-0", model, (comparable, most))
            phases = [("one server", lambda: run_one(block_size, states, interval))]
        else:
            per_phase = (comparable // len(ORDERS), most // len(ORDERS))
            phases = [
                (
                    f"started {' then '.join(order)}",
                    functools.partial(phase, workdir / f"phase-{i}", model, order, per_phase, block_size, intervals),
                )
                for i, order in enumerate(ORDERS)
            ]
        for index, (what, run) in enumerate(phases):
            done = run()
            kept = [pair for pair in done.pairs if pair.comparable]
            decode = statistics.median(pair.off.itl_ms / pair.on.itl_ms for pair in kept) if kept else math.nan
            report.note(
                f"phase {index} ({what})",
                f"{len(done.pairs)} pairs, {len(kept)} comparable, decode rate on / off {decode:.4f}; "
                f"the sampler ran {done.sampled_s:.0f} s",
            )
            pairs.extend(done.pairs)
    load = summarize([block.foreign_cores for pair in pairs for block in (pair.on, pair.off)])
    report.stats("other processes' load during a block", load, "cores")
    kept = [pair for pair in pairs if pair.comparable]
    claim = 0.0
    for name, unit, figure in FIGURES:
        on, off = [figure(p.on) for p in kept], [figure(p.off) for p in kept]
        report.stats(f"{name}, observation on", summarize(on), unit)
        report.stats(f"{name}, observation off", summarize(off), unit)
        ratios = list(map(operator.truediv, on, off))
        low, high = median_interval(ratios)
        report.note(f"{name}: on / off, medians", f"{statistics.median(on) / statistics.median(off):.4f}")
        report.note(f"{name}: on / off, median of pairs", f"{statistics.median(ratios):.4f} ({low:.3f}-{high:.3f})")
        if name == DECODE_RATE:
            claim = statistics.median(ratios)
    every = statistics.median(p.on.tokens_per_s / p.off.tokens_per_s for p in pairs)
    report.note("tokens per s: on / off, median of every pair (comparable or not)", f"{every:.4f}")
    samples = [p.on.sample_ms for p in pairs if p.on.sample_ms is not None]
    if control or intervals["on"] == "0":
        return claim
    report.note('"on" blocks during which the worker sampled', f"{len(samples)} of {len(pairs)}")
    if not samples:
        return claim
    report.stats("a sample in the engine's worker (wall)", summarize(samples))
    report.note("caches in those samples (median)", statistics.median(p.on.sampled_caches for p in pairs))
    share = statistics.median(samples) / 1000 / float(interval)
    report.note("the sampler's share of the worker's time (median sample / interval)", f"{share:.5f}")
    return claim


PER_STEP_METHOD = f"""
--per-step: one such server, observation running (every --interval seconds); its test worker (KvxRequestsCPUWorker,
StepArms) runs the engine's steps in adjacent pairs, one step with the hook's step-path work on and one off, in
random order (off: the tracker's hooks report nowhere, every wrapped cache method is its original, as a paused
observation leaves them, and the runner's step record wrapper is taken off the instance; the sampler thread runs
throughout), and times the worker's call of its runner (`self.model_runner.execute_model`).
A pair counts where both steps are decode steps of all {MAX_NUM_SEQS} sequences (one token each). The claim is the
median of the pairs' ratios, off / on (the decode rate on against off), with the 95% interval of that median
(order statistics), beside the ratio of the arms' medians. The time is the runner's call only (the engine's
scheduling and output handling, ~30% more a step, are left out), so the ratio overstates the share of a whole step.
A cache made in an "off" step is never tracked, and one made in an "on" step and released in an "off" one charges its
release to "off": the long-lived per-request caches (a few percent of what the hooks see a step here).
The step record alone: before every step, outside its timing, one call each, in random order, with that step's
scheduler output, each timed (perf_counter_ns): a plain function; a Python function calling it (the least any
wrapper adds); the step record's writer around it with its record closed (its C-to-Python call alone); the writer.
The first call meets the step's cold caches, so each arm's cost is its median less the plain call's in the same
position: first, and later (second to last, pooled); the record's cost a step is the writer's, averaged over the
two. The plain function reads what the writer reads (`len(scheduler_output.num_scheduled_tokens)`, as every runner
does in its step). The probe's wrapped call returns at once, so its end (the record's second write and the return
into C) is warm; in a real step it follows the model's forward, cold (`bench.micro_step_record` times both sides).
--control: the plain function in every arm, so the figures show what the timing resolves.
"""


PER_STEP_WAVES = 200  # ~8,000 steps, ~3,500 pairs of decode steps at 40 tokens: an interval ~1.5% wide here
BLOCK_WAVES = 5


def per_step(report: Report, waves: int, tokens: int, interval: str, control: bool) -> float:
    """The decode rate on / off: the median of adjacent step pairs' ratios (off / on), on one server."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = build_model(workdir / "model", architecture=g.OBSERVED_ARCHITECTURE)
        server = start(workdir / "server", model, interval, VLLM_SERVER_DEV_MODE="1")
        try:
            server.wait_ready()
            block(server, Machine({"on": server}), 1, tokens)  # warm-up, not counted
            assert server.collective_rpc("kvx_observation", "running") == ["running"]
            server.collective_rpc("kvx_step_arms", "control" if control else "on")
            for _ in range(waves):
                server.batched_completion(MAX_NUM_SEQS, tokens)
            [times] = server.collective_rpc("kvx_step_arms", "off")
            state = observation(server)[0]
        finally:
            server.stop()
    assert state is ObservationState.OK, state
    pairs: dict[int, dict[bool, float]] = collections.defaultdict(dict)
    probes: list[dict[str, tuple[int, int]]] = []
    for pair, on, sequences, decode, ns, probe in times:
        probes.append(probe)
        if sequences == MAX_NUM_SEQS and decode:
            pairs[pair][on] = ns / 1e6
    whole = [arms for arms in pairs.values() if len(arms) == 2]
    for on in (True, False):
        report.stats(
            f"a decode step ({MAX_NUM_SEQS} sequences), hooks {'on' if on else 'off'}",
            summarize([arms[on] for arms in whole]),
        )
    ratios = [arms[False] / arms[True] for arms in whole]
    ratio, (low, high) = statistics.median(ratios), median_interval(ratios)
    added = statistics.median([arms[True] - arms[False] for arms in whole])
    report.note("pairs of adjacent decode steps", f"{len(whole)} of {len(pairs)}")
    report.note("a decode step: median of pairs' on - off", f"{added * 1000:.1f} us")
    report.note(
        "ratio of the arms' medians (off / on)",
        f"{statistics.median([a[False] for a in whole]) / statistics.median([a[True] for a in whole]):.4f}",
    )
    report.note("decode rate on / off: median of pairs (95% interval)", f"{ratio:.4f} ({low:.4f}-{high:.4f})")
    record_ns = record_cost(report, probes)
    if not control:
        report.check(
            f"the step record costs at most {RECORD_BUDGET_NS} ns a step (median, in the worker)",
            f"{record_ns:.0f} ns",
            record_ns <= RECORD_BUDGET_NS,
        )
    return ratio


def record_cost(report: Report, probes: list[dict[str, tuple[int, int]]]) -> float:
    """The step record's cost a step: the writer's median less the plain call's, each where it came first (cold) and
    where it came later, averaged over the two (control: plain calls in every arm, so ~0). Beside it, the same for
    every arm of the probe."""

    def median_ns(arm: str, first: bool) -> float:
        return statistics.median(probe[arm][0] for probe in probes if (probe[arm][1] == 0) == first)

    plain = (median_ns("plain", True), median_ns("plain", False))
    report.note(
        f"the probe's plain call: median ns over {len(probes)} steps, called first / later",
        f"{plain[0]:.0f} / {plain[1]:.0f}",
    )
    costs = {}
    for arm in probes[0]:
        cold, warm = median_ns(arm, True) - plain[0], median_ns(arm, False) - plain[1]
        costs[arm] = (cold + warm) / 2
        report.note(
            f"the probe's {arm!r} less plain: ns called first / later / mean",
            f"{cold:+.0f} / {warm:+.0f} / {costs[arm]:+.0f}",
        )
    return costs["writer"]


def median_interval(values: list[float]) -> tuple[float, float]:
    """A 95% confidence interval of the median: order statistics n/2 -+ 1.96 sqrt(n)/2 (the binomial's normal
    approximation), so the reader sees what this machine's noise lets the pairs resolve."""
    ordered, half = sorted(values), 1.96 * math.sqrt(len(values)) / 2
    low = max(0, math.floor(len(values) / 2 - half))
    high = min(len(values) - 1, math.ceil(len(values) / 2 + half) - 1)
    return ordered[low], ordered[high]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # 96: the fewest that resolved 1% here (24 pairs gave a 95% interval ~3.4% wide, 96 pairs 1.6%)
    parser.add_argument("--pairs", type=int, default=96, help="comparable pairs of blocks to collect, both phases")
    parser.add_argument("--most", type=int, default=120, help="pairs of blocks to run at most, both phases")
    parser.add_argument(
        "--waves", type=int, help=f"waves of {MAX_NUM_SEQS} completions per block (5), or in all with --per-step (200)"
    )
    parser.add_argument("--tokens", type=int, default=200, help="tokens per completion (max-model-len is 256)")
    parser.add_argument(
        "--control",
        action="store_true",
        help="both arms alike (what noise is): two servers "
        "with observation off, or one whose observation runs in both arms",
    )
    parser.add_argument("--same-server", action="store_true", help="one server pausing and resuming its observation")
    parser.add_argument(
        "--per-step", action="store_true", help="one server, adjacent steps with the hooks on and off (the claim)"
    )
    parser.add_argument("--interval", default=ON_INTERVAL, help="KV_EXPORTER_OBSERVE_INTERVAL with observation on")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        print("bench_decode: no .venv-vllm (run `make engine-env`)", file=sys.stderr)
        return 2
    title = "Engine decode throughput, observation on and off (real vLLM CPU servers)"
    if args.same_server or args.per_step:
        title += ", one server" + (", per step" if args.per_step else "")
    if args.control:
        title += ": control, both arms alike"
    extra = PER_STEP_METHOD if args.per_step else SAME_SERVER_METHOD if args.same_server else ""
    report = Report(title, METHOD + extra)
    report.start()
    if args.per_step:
        ratio = per_step(report, args.waves or PER_STEP_WAVES, args.tokens, args.interval, args.control)
        claim = "per step"
    else:
        args.waves = args.waves or BLOCK_WAVES
        blocks = f"{args.waves} x {MAX_NUM_SEQS} completions x {args.tokens} tokens"
        report.note("pairs", f"{args.pairs} comparable wanted, {args.most} at most; a block: {blocks}")
        block_size = (args.waves, args.tokens)
        report.note("observation interval when on", f"{args.interval} s")
        ratio = measure(report, args.pairs, args.most, block_size, args.control, args.same_server, args.interval)
        claim = "median of pairs"
    if args.control:
        report.note(f"control: both arms alike, {claim} ('on' / 'off')", f"{ratio:.4f}")
    else:
        report.check(
            f"decode rate with observation on >= {1 - SLOWDOWN_BUDGET:.2f} x off ({claim})",
            f"{ratio:.4f} x",
            ratio >= 1 - SLOWDOWN_BUDGET,
        )
    report.finish(args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
