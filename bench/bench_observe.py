"""What observing the live caches costs a worker: per cache created, per cache update, per sample, and for other
threads' GIL.

    .venv/bin/python -m bench.bench_observe [--repeats N] [--creations N] [--steps N] [--sizes 10,100,1000]
        [--json-out FILE]

Three parts, in the same run. Creation: `DynamicCache()` made (and dropped) in a loop inside a model's
forward, tracked against untracked. Sample: the whole sample's wall and CPU time at 10, 100 and 1,000 live
caches. GIL: the longest a busy probe thread waits while a sample runs, against the same probe with no sample,
and against a sample that never pauses. A missed target is reported (MISS), not an error.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from bench.benchlib import Report, summarize
from kv_exporter.observation import ObservationState
from kv_exporter.plugin import observe
from kv_exporter.plugin.hooks import install_post_import
from kv_exporter.plugin.observe.sampler import PAUSE_S
from kv_exporter.plugin.settings import HookSettings

LAYERS = 28  # Qwen2.5-7B and Qwen3-TTS talker depth: the layer count sets a sample's work, tensor sizes do not
WORKER_FRAMES = 25  # frames under the model's forward in a vLLM worker (busy loop, executor, runner, ...)
TREE_MODULES = 10_000
CREATION_BUDGET_US = 2.0  # added per cache, created in a declarer's code
UPDATE_BUDGET_US = 5.0  # added per layer update (two K/V assignments) by the high-water mark
GIL_BUDGET_MS = 1.0  # longest GIL hold per sample at 1,000 live caches

METHOD = f"""
Creation: `DynamicCache()` (the cheapest cache to make, so the largest ratio) made and dropped N times in a loop in
a forward, {WORKER_FRAMES} plain frames below the root module's call (a worker's depth). Cases: in a helper a
declaring owner's forward calls; in one of {LAYERS} undeclared layers sharing one class (its `self` is read); in a
worker frame outside the model (walks the whole stack); before `attach` (load time). Per-creation time = loop
time / N, create + release; median over repeats, tracked and untracked runs interleaved.
Sample: N live DynamicCaches of {LAYERS} layers each (K and V in every layer), `observe.observe()` in the main
thread; wall time and thread CPU time; median over repeats.
GIL: a probe thread spins reading perf_counter and keeps the largest gap between two readings while one sample
runs in the main thread; baseline: the same probe for the same time with no sample; and the same sample with
its pauses turned into no-ops (only Python's 5 ms switch interval lets the probe in). A gap also holds the
probe's own wake-up after the sampler lets go, which a loaded machine stretches; "longest slice, inside" is the
sampler's own longest stretch of work between two pauses (no probe running). Medians over repeats.
Attach: `observe.attach` on a {TREE_MODULES:,}-module tree (the publisher calls it once per phase).
Update: a fresh {LAYERS}-layer DynamicCache given S one-position decode steps (`cache.update` per layer, K and V of
2 heads x 64, fp32): time per layer update with the high-water mark's accounting on against off (its hooks
removed), interleaved; median over repeats.
"""


# -- a model shaped like a worker's ---------------------------------------------------------------------------


def made_in_helper(count: int) -> None:
    for _ in range(count):
        DynamicCache()


class Talker(nn.Module):
    def model_local_kv_specs(self) -> list[Any]:
        return []

    def forward(self, count: int) -> None:
        made_in_helper(count)


class Layer(nn.Module):
    def forward(self, count: int) -> None:
        for _ in range(count):
            DynamicCache()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.talker = Talker()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, case: str, count: int) -> None:
        if case == "layer":
            self.layers[LAYERS // 2](count)
        else:
            self.talker(count)


def in_worker(depth: int, work: Callable[[], None]) -> None:
    """`work` run under `depth` plain frames, as a forward runs under vLLM's worker loop."""
    if depth:
        in_worker(depth - 1, work)
    else:
        work()


def creation_loop(model: Model, case: str, count: int) -> float:
    """Seconds per cache created (and released) for one case."""

    def work() -> None:
        if case == "outside":
            made_in_helper(count)
        else:
            model(case, count)

    started = time.perf_counter()
    in_worker(WORKER_FRAMES, work)
    return (time.perf_counter() - started) / count


# -- switching the tracker on and off -------------------------------------------------------------------------


def tracking(model: Model | None) -> None:
    observe.reset_for_tests()
    settings = HookSettings(False, Path("/nonexistent"), True, "auto", observe_interval_s=1.0)
    install_post_import(observe.patches(settings))
    if model is not None:
        observe.attach(model, ["talker"], torch.device("cpu"))


def untracked() -> None:
    observe.reset_for_tests()


def creation_costs(report: Report, repeats: int, count: int) -> dict[str, float]:
    model = Model()
    cases = {"declarer": model, "layer": model, "outside": model, "before attach": None}
    tracked: dict[str, list[float]] = {case: [] for case in cases}
    bare: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(repeats):
        for case, attached in cases.items():
            loop_case = "declarer" if case == "before attach" else case
            untracked()
            bare[case].append(creation_loop(model, loop_case, count))
            tracking(attached)
            tracked[case].append(creation_loop(model, loop_case, count))
    untracked()
    added: dict[str, float] = {}
    for case in cases:
        ours, base = summarize([s * 1e6 for s in tracked[case]]), summarize([s * 1e6 for s in bare[case]])
        report.stats(f"create: {case}, tracked", ours, "us")
        report.stats(f"create: {case}, untracked", base, "us")
        report.ratio(f"create: {case} (tracked/untracked)", ours.median, base.median)
        added[case] = ours.median - base.median
        report.note(f"create: {case}, added per cache (us)", f"{added[case]:.2f}")
    return added


# -- cache updates (the high-water mark's per-step cost) -------------------------------------------------------


def decode_steps(steps: int) -> float:
    """Seconds per layer update: `steps` one-position decode steps of a fresh LAYERS-layer DynamicCache."""
    token = torch.zeros(1, 2, 1, 64)
    cache = DynamicCache()
    started = time.perf_counter()
    for _ in range(steps):
        for layer in range(LAYERS):
            cache.update(token, token, layer)
    return (time.perf_counter() - started) / (steps * LAYERS)


def update_costs(report: Report, repeats: int, steps: int) -> float:
    """The time one layer update gains with the peak accounting on (two K/V assignments: release old, take new)."""
    tracked, bare = [], []
    for _ in range(repeats):
        untracked()
        bare.append(decode_steps(steps) * 1e6)
        tracking(None)
        tracked.append(decode_steps(steps) * 1e6)
    untracked()
    ours, base = summarize(tracked), summarize(bare)
    report.stats("update: per layer update, tracked", ours, "us")
    report.stats("update: per layer update, untracked", base, "us")
    report.ratio("update (tracked/untracked)", ours.median, base.median)
    added = ours.median - base.median
    report.note("update: added per layer update (us)", f"{added:.2f}")
    return added


# -- samples --------------------------------------------------------------------------------------------------


def live_caches(count: int) -> list[DynamicCache]:
    caches = []
    keys = torch.zeros(1, 2, 4, 8)
    for _ in range(count):
        cache = DynamicCache()
        for layer in range(LAYERS):
            cache.update(keys, keys, layer)
        caches.append(cache)
    return caches


class Probe:
    """A thread that spins and records the longest gap between two of its own clock readings."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _spin(self) -> None:
        clock, stop, longest = time.perf_counter, self._stop, 0.0
        last = clock()  # before saying ready: a wait right after it must count
        self._ready.set()
        while not stop.is_set():
            now = clock()
            longest = max(longest, now - last)
            last = now
        self.longest = max(longest, clock() - last)  # the wait that lasted until `stop` counts too


def probed(run: Callable[[], object]) -> tuple[float, float]:
    """(longest probe gap, seconds `run` took), both in ms."""
    gc.collect()  # a full collection the setup left due is no sample's doing
    with Probe() as probe:
        started = time.perf_counter()
        run()
        took = time.perf_counter() - started
    return probe.longest * 1000, took * 1000


def longest_slice() -> float:
    """The longest stretch (ms) one sample works between two of its pauses, timed inside the sampling thread."""
    gc.collect()
    marks = [time.perf_counter()]

    def pause() -> None:
        marks.append(time.perf_counter())
        time.sleep(PAUSE_S)
        marks.append(time.perf_counter())

    observe.observe(pause=pause)
    marks.append(time.perf_counter())
    return max(end - start for start, end in zip(marks[::2], marks[1::2], strict=True)) * 1000


def sample_costs(report: Report, sizes: list[int], repeats: int) -> dict[int, float]:
    tracking(None)
    longest_sliced: dict[int, float] = {}
    for size in sizes:
        caches = live_caches(size)
        walls, cpus, slices, sliced, unsliced, idle = [], [], [], [], [], []
        for _ in range(repeats):
            gc.collect()
            wall, cpu = time.perf_counter(), time.thread_time()
            observation = observe.observe()
            walls.append((time.perf_counter() - wall) * 1000)
            cpus.append((time.thread_time() - cpu) * 1000)
            assert observation.state is ObservationState.OK, observation.reason
            assert sum(owner.caches for owner in observation.owners) == size
            slices.append(longest_slice())
            gap, took = probed(observe.observe)
            sliced.append(gap)
            unsliced.append(probed(lambda: observe.observe(pause=lambda: None))[0])
            idle.append(probed(lambda took=took: time.sleep(took / 1000))[0])
        report.stats(f"sample at {size} caches: wall", summarize(walls))
        report.stats(f"sample at {size} caches: CPU", summarize(cpus))
        report.stats(f"sample at {size} caches: longest slice, inside", summarize(slices))
        report.stats(f"sample at {size} caches: longest probe gap", summarize(sliced))
        report.stats(f"sample at {size} caches: gap, never pausing", summarize(unsliced))
        report.stats(f"sample at {size} caches: gap, no sample", summarize(idle))
        report.ratio(f"gap at {size} (sample/no sample)", statistics.median(sliced), statistics.median(idle))
        longest_sliced[size] = statistics.median(sliced)
        del caches
    untracked()
    return longest_sliced


def attach_cost(report: Report, repeats: int) -> float:
    blocks = nn.ModuleList(nn.Sequential(*(nn.Identity() for _ in range(99))) for _ in range(TREE_MODULES // 100))
    tree = nn.Sequential(blocks)
    tracking(None)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        observe.attach(nn.Sequential(*tree.children()), [])  # a new root each time: attach rebuilds its map
        times.append((time.perf_counter() - started) * 1000)
    untracked()
    stats = summarize(times)
    report.stats(f"attach on {sum(1 for _ in tree.modules()):,} modules", stats)
    return stats.median


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--creations", type=int, default=20_000)
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per update run")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    report = Report("Observation: cost per cache created, per sample, and GIL hold", METHOD)
    report.start()
    report.note("python", sys.version.split()[0])
    report.note("switch interval (ms)", sys.getswitchinterval() * 1000)
    added = creation_costs(report, args.repeats, args.creations)
    update_added = update_costs(report, args.repeats, args.steps)
    longest = sample_costs(report, [int(size) for size in args.sizes.split(",")], args.repeats)
    attach_cost(report, args.repeats)
    report.check(
        f"<= {CREATION_BUDGET_US:g} us added per cache made in a declarer's code",
        f"{added['declarer']:.2f} us",
        added["declarer"] <= CREATION_BUDGET_US,
    )
    report.check(
        f"<= {UPDATE_BUDGET_US:g} us added per layer update",
        f"{update_added:.2f} us",
        update_added <= UPDATE_BUDGET_US,
    )
    biggest = max(longest)
    report.check(
        f"longest GIL hold per sample at {biggest:,} caches <= {GIL_BUDGET_MS:g} ms",
        f"{longest[biggest]:.2f} ms",
        longest[biggest] <= GIL_BUDGET_MS,
    )
    report.finish(args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
