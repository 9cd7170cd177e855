"""Where the step record's cost goes: a runner's `execute_model` called in isolation, plain and through the record's
writer, timed on each side of the step, with the caches walked over as a model's step walks over them.

    .venv/bin/python -m bench.micro_step_record [--rounds N] [--walk-mib N]

Arms (each a runner of its own, called as vLLM's worker calls it: `runner.execute_model(scheduler_output)`):
  plain    the class's method, Python to Python (3.11's interpreter runs the callee in its caller's C frame)
  python   a Python function on the instance that calls the method and does nothing else: any wrapper's floor
  closed   the hook's `StepWrapper` with its record closed: its C-to-Python call of the method, nothing written
  getattr  `python` with `getattr(scheduler_output, "num_scheduled_tokens")` by the builtin before its call: the
           generic attribute lookup from C, which the writer makes to count the step's sequences
  wrapper  the hook's `StepWrapper`, its record a mapped file (MAP_SHARED, as `kv_exporter.plugin.steps` maps it)
The method reads `len(scheduler_output.num_scheduled_tokens)` first, as every runner does (the scheduler output: a
dataclass with 8 requests), then walks `--walk-mib` MiB (a copy; twice this machine's 4 MiB L2 by default) as the
model's forward would, and returns. Timed with perf_counter_ns: the step's begin side, from the caller's call to the
method's first clock read after its count (the count read in every arm alike), after the caller walked the caches too
(the previous step's forward); the end side, from the method's last clock read to the caller's after the return. A
step's cost is the two sides' medians, each less plain's. Warm: the arms called back to back without walking, whole
calls timed. Arms interleave in random order each round. A profile, not a target: the claim is `bench_decode
--per-step`'s.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.benchlib import Report
from kv_exporter.plugin._steps import Record, StepWrapper
from kv_exporter.steprecord import RECORD_BYTES, new_record

CLOCK = time.perf_counter_ns


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int] = field(default_factory=lambda: {f"req-{i}": 1 for i in range(8)})


class Walk:
    """The model's forward, as far as the caches see it: `size` bytes copied (0: nothing)."""

    def __init__(self, size: int) -> None:
        self.source, self.sink = bytearray(size), bytearray(size)

    def __call__(self) -> None:
        self.sink[:] = self.source


class Runner:
    def __init__(self, walk: Walk) -> None:
        self.walk = walk
        self.entered = self.leaving = 0

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> int:
        count = len(scheduler_output.num_scheduled_tokens)
        self.entered = CLOCK()
        self.walk()
        self.leaving = CLOCK()
        return count


def mapped(folder: Path) -> mmap.mmap:
    """A new record file mapped writable, as `kv_exporter.plugin.steps` maps it."""
    fd, _ = tempfile.mkstemp(suffix=".steps", dir=folder)
    try:
        os.write(fd, new_record(os.getpid(), 0))
        return mmap.mmap(fd, RECORD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def arms(folder: Path, walk: Walk) -> dict[str, Runner]:
    """Each arm's runner, its wrapper (if any) on the instance, where the hook puts its own."""
    runners = {name: Runner(walk) for name in ("plain", "python", "getattr", "closed", "wrapper")}
    method, counted = runners["python"].execute_model, runners["getattr"].execute_model

    def python(scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        return method(scheduler_output, intermediate_tensors)

    def lookup(scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        getattr(scheduler_output, "num_scheduled_tokens")  # noqa: B009 - the generic lookup from C is the point
        return counted(scheduler_output, intermediate_tensors)

    closed = Record(mapped(folder))
    wrappers = {
        "python": python,
        "getattr": lookup,
        "closed": StepWrapper(runners["closed"].execute_model, closed),
        "wrapper": StepWrapper(runners["wrapper"].execute_model, Record(mapped(folder))),
    }
    closed.close()
    for name, wrapper in wrappers.items():
        vars(runners[name])["execute_model"] = wrapper
    return runners


def sides(runners: dict[str, Runner], rounds: int, walk: Walk) -> dict[str, list[tuple[int, int]]]:
    """(begin side, end side) ns of each arm's calls, the caches walked before each call and inside it."""
    so = SchedulerOutput()
    names = list(runners)
    times: dict[str, list[tuple[int, int]]] = {name: [] for name in names}
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            runner = runners[name]
            walk()
            a = CLOCK()
            runner.execute_model(so)
            b = CLOCK()
            times[name].append((runner.entered - a, b - runner.leaving))
    return times


def warm(runners: dict[str, Runner], rounds: int) -> dict[str, list[int]]:
    """ns of whole calls, each arm called twice in a row and the second timed."""
    so = SchedulerOutput()
    names = list(runners)
    times: dict[str, list[int]] = {name: [] for name in names}
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            runner = runners[name]
            runner.execute_model(so)
            a = CLOCK()
            runner.execute_model(so)
            times[name].append(CLOCK() - a)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4_000, help="timed steps of each arm (warm: 5x as many calls)")
    parser.add_argument("--walk-mib", type=int, default=8, help="MiB the model's forward walks over")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    report = Report("The step record's writer in isolation: where its cost goes", __doc__ or "")
    report.start()
    with tempfile.TemporaryDirectory() as tmp:
        idle = arms(Path(tmp), Walk(0))
        whole = warm(idle, args.rounds * 5)
        plain = statistics.median(whole["plain"])
        for name, values in whole.items():
            report.note(f"warm: {name}, a call, median ns (less plain's)", f"{statistics.median(values) - plain:+.0f}")
        walk = Walk(args.walk_mib << 20)
        stepped = sides(arms(Path(tmp), walk), args.rounds, walk)
        base = [statistics.median(side[i] for side in stepped["plain"]) for i in (0, 1)]
        report.note("cold: plain, begin / end side, median ns", f"{base[0]:.0f} / {base[1]:.0f}")
        for name, values in stepped.items():
            begin, end = (statistics.median(side[i] for side in values) - base[i] for i in (0, 1))
            report.note(
                f"cold: {name}, begin / end side / a step, ns less plain's",
                f"{begin:+.0f} / {end:+.0f} / {begin + end:+.0f}",
            )
    report.finish(args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
