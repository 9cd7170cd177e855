"""How long the hook holds up model load: collection plus publish on a 10,000-module tree (budget: 50 ms).

Runs standalone: `.venv/bin/python -m bench.bench_hook [--modules N] [--repeats N] [--json]`. Three timings on
the same tree, in the same run: a bare `named_modules()` walk (the baseline no collector can beat), the
collection alone (walk + declarations + conversion), and the whole publish (collection, identity, manifest,
strict self-check, atomic write with fsync, summary log). Exit status 1 when the publish median exceeds the
budget.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from kv_exporter.manifest import Phase
from kv_exporter.plugin.collect import collect, to_declarations
from kv_exporter.plugin.oncelog import logger
from kv_exporter.plugin.publish import publish
from kv_exporter.plugin.settings import COLLECTOR_CHOICES, HookSettings
from kv_exporter.reference import REFERENCE_MODELS

BUDGET_MS = 50.0


class Owner(nn.Module):
    def __init__(self, specs: list[Any]) -> None:
        super().__init__()
        self.specs = specs

    def model_local_kv_specs(self) -> list[Any]:
        return self.specs


def build_tree(modules: int) -> nn.Module:
    """`modules` modules in all: 100-wide blocks of leaves, with the reference models' owners spread through."""
    root = nn.Module()
    owners = [Owner([spec for _, spec in model.declarations]) for model in REFERENCE_MODELS]
    blocks = nn.ModuleList()
    root.blocks = blocks
    count = 2 + len(owners)  # root, the block list, the owners
    while count < modules:
        block = nn.ModuleList()
        blocks.append(block)
        count += 1
        for _ in range(min(99, modules - count)):
            block.append(nn.Identity())
            count += 1
    for i, owner in enumerate(owners):  # deep inside, as real owners are
        blocks[(i + 1) * len(blocks) // (len(owners) + 1)].append(owner)
    return root


def time_ms(function: Callable[[], object], repeats: int) -> list[float]:
    function()  # warm caches (and the collector lookup) once
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]

    return {
        "median": statistics.median(ordered),
        "p90": pct(90),
        "p99": pct(99),
        "min": ordered[0],
        "max": ordered[-1],
    }


def run(modules: int, repeats: int, collector: str = "kv_exporter") -> dict[str, Any]:
    tree = build_tree(modules)
    actual = sum(1 for _ in tree.named_modules())
    runner = SimpleNamespace(
        model=tree,
        device=torch.device("cpu"),
        scheduler_config=SimpleNamespace(max_num_seqs=256),
        model_config=SimpleNamespace(served_model_name="bench", stage_id=0),
        parallel_config=SimpleNamespace(data_parallel_rank=0, data_parallel_index=0),
    )
    # The summary is logged as in vLLM, into a buffer instead of the terminal.
    logger.addHandler(logging.StreamHandler(io.StringIO()))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    with tempfile.TemporaryDirectory() as folder:
        settings = HookSettings(disabled=False, directory=Path(folder), explicit_directory=True, collector=collector)
        used = collect(tree, collector)[0]
        timings = {
            "walk": time_ms(lambda: sum(1 for _ in tree.named_modules()), repeats),
            "collect": time_ms(lambda: to_declarations(collect(tree, collector)[1]), repeats),
            "publish": time_ms(lambda: publish(runner, Phase.LOAD, settings), repeats),
        }
        written = len(list(Path(folder).glob("*.json")))
    stats = {name: summary(samples) for name, samples in timings.items()}
    return {
        "modules": actual,
        "collector": used,
        "declarations": sum(len(model.declarations) for model in REFERENCE_MODELS),
        "repeats": repeats,
        "ms": stats,
        "publish_over_walk": stats["publish"]["median"] / stats["walk"]["median"],
        "collect_over_walk": stats["collect"]["median"] / stats["walk"]["median"],
        "budget_ms": BUDGET_MS,
        "within_budget": stats["publish"]["median"] < BUDGET_MS,
        "manifests_written": written,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--collector",
        choices=COLLECTOR_CHOICES,
        default="kv_exporter",
        help="as KV_EXPORTER_COLLECTOR (vllm-omni's needs its wheel installed, e.g. in .venv-vllm)",
    )
    args = parser.parse_args()
    result = run(args.modules, args.repeats, args.collector)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{result['modules']} modules, {result['declarations']} declarations, collector {result['collector']}, "
            f"{result['repeats']} repeats (ms)"
        )
        for name, stats in result["ms"].items():
            cells = "  ".join(f"{key} {value:7.2f}" for key, value in stats.items())
            print(f"  {name:8s} {cells}")
        print(f"  publish / bare walk: {result['publish_over_walk']:.2f}x; collect / walk: "
              f"{result['collect_over_walk']:.2f}x")  # fmt: skip
        verdict = "within" if result["within_budget"] else "OVER"
        print(f"  publish median {result['ms']['publish']['median']:.2f} ms: {verdict} the {BUDGET_MS:.0f} ms budget")
    return 0 if result["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
