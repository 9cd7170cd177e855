"""Where the hooks' time lands in a decode step: the engine tests' in-step owner (`kvx_observed.in_step`) run in this
process, in adjacent pairs of steps with the hooks on and off (as the decode benchmark's worker does), each section
of the step timed on its own.

    .venv/bin/python -m bench.profile_step [--pairs N] [--running N]

A step: `running` per-request DynamicCaches, each made and then filled by a real forward of a tiny transformers Qwen2
(the side geometry: 2 layers), their batched concatenation, a deep copy of it, all released at the end; what the
decode benchmark's in-step owner does (tests/engine/testplugin/kvx_testplugin/observed.py), without vLLM around it.
Off: the hooks report nowhere and every wrapped method is its original again (the decode benchmark's `StepArms`);
the cache class's own `__new__` and finalizer stay in both arms, as there. Sections: `new` (the per-request caches
made), `fill` (their forwards, where each layer's `update` runs), `batch` (the concatenation), `copy` (the deep
copy), `release` (all of them dropped: the finalizer reads what each held last). Figures are medians of the pairs'
on - off, in microseconds, with the whole step's ratio off / on. A profile, not a target: the claim is the decode
benchmark's.
"""

from __future__ import annotations

import argparse
import collections
import copy
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, Qwen2Config, Qwen2Model

from bench.benchlib import Report
from kv_exporter.plugin import observe
from kv_exporter.plugin.hooks import install_post_import
from kv_exporter.plugin.settings import HookSettings
from tests.engine.server import MAX_NUM_SEQS
from tests.engine.testplugin.kvx_testplugin import geometry as g
from tests.support.plugin_state import stop_observing

SECTIONS = ("new", "fill", "batch", "copy", "release")


class InStep(nn.Module):
    """The in-step owner's work, each section timed into `spent` (ns)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = Qwen2Config(
            vocab_size=64,
            hidden_size=g.SIDE_HIDDEN,
            intermediate_size=128,
            num_hidden_layers=g.SIDE_LAYERS,
            num_attention_heads=g.SIDE_HEADS,
            num_key_value_heads=g.SIDE_KV_HEADS,
        )
        self.lm = Qwen2Model(config).eval()  # type: ignore[no-untyped-call]
        self.prompt = torch.arange(g.STEP_POSITIONS).unsqueeze(0)
        self.spent: collections.Counter[str] = collections.Counter()

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        started = time.perf_counter_ns()
        yield
        self.spent[name] += time.perf_counter_ns() - started

    def forward(self, running: int) -> None:
        caches: list[Any] = []
        for _ in range(running):
            with self.section("new"):
                cache = DynamicCache()
            with self.section("fill"), torch.no_grad():
                self.lm(input_ids=self.prompt, past_key_values=cache, use_cache=True)
            caches.append(cache)
        with self.section("batch"):
            batched = DynamicCache()
            for layer in range(g.SIDE_LAYERS):
                keys = torch.cat([cache.layers[layer].keys for cache in caches])
                values = torch.cat([cache.layers[layer].values for cache in caches])
                batched.update(keys, values, layer)
            caches.append(batched)
        with self.section("copy"):
            caches.append(copy.deepcopy(batched))
        del cache, batched
        with self.section("release"):
            caches.clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1500)
    parser.add_argument("--running", type=int, default=MAX_NUM_SEQS, help="per-request caches a step")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    report = Report("Where the hooks' time lands in a decode step (in process)", __doc__ or "")
    report.start()
    torch.set_num_threads(1)  # a step's sections then time the thread's own work (bench_observe's reason)
    work = InStep()
    settings = HookSettings(False, Path("/nonexistent"), True, "auto", observe_interval_s=1.0)
    install_post_import(observe.patches(settings))
    observe.attach(work, [], torch.device("cpu"))  # the worker's model is known: caches are named by their frames
    apply = observe._observer.registry.step_switch()  # as the decode benchmark's worker switches
    for _ in range(50):
        work(args.running)
    spent: dict[bool, dict[str, list[int]]] = {arm: collections.defaultdict(list) for arm in (True, False)}
    for _ in range(args.pairs):
        first = random.random() < 0.5
        for hooked in (first, not first):
            apply(hooked)
            work.spent.clear()
            started = time.perf_counter_ns()
            work(args.running)
            spent[hooked]["step"].append(time.perf_counter_ns() - started)
            for name in SECTIONS:
                spent[hooked][name].append(work.spent[name])
    apply(True)
    stop_observing()
    for name in ("step", *SECTIONS):
        added = statistics.median(a - b for a, b in zip(spent[True][name], spent[False][name], strict=True)) / 1000
        off = statistics.median(spent[False][name]) / 1000
        report.note(f"{name}: off (median us) / added on - off (median of pairs, us)", f"{off:.1f} / {added:.1f}")
    pairs = list(zip(spent[True]["step"], spent[False]["step"], strict=True))
    report.note("a step's rate on / off (median of pairs)", f"{statistics.median(off / on for on, off in pairs):.4f}")
    report.finish(args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
