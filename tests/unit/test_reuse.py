"""What a scrape reuses from the last one (sidecar/declared.py, the frozen declaration families, the exposition's
frozen texts) renders the same page as building everything afresh, across changes of every input kind."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_exporter.gpu import GpuMemory
from kv_exporter.manifest import DeviceInfo, Manifest, PodInfo
from kv_exporter.observation import Observation, ObservationState, OwnerObservation
from kv_exporter.reference import MIMO_AUDIO, MINICPM_O, QWEN3_TTS
from kv_exporter.sidecar.budget import NO_CAP, SeriesCap
from kv_exporter.sidecar.declared import DeclaredCache
from kv_exporter.sidecar.engine_page import scan_page
from kv_exporter.sidecar.exposition import Exposition
from kv_exporter.sidecar.families import DeclarationFamilies, families
from kv_exporter.sidecar.inputs import assess
from kv_exporter.sidecar.records import GpuResult, PageResult
from kv_exporter.sidecar.snapshot import build_snapshot
from tests.support.constants import GIB, OTHER_NS, gpu_uuid
from tests.support.manifests import reference_manifest
from tests.support.pages import vllm_page_with

FORMATS = ("text/plain; version=0.0.4; charset=utf-8", "application/openmetrics-text; version=1.0.0; charset=utf-8")
MODELS = (QWEN3_TTS, MIMO_AUDIO, MINICPM_O)
NOW = 1_764_480_100.0


@dataclasses.dataclass
class Inputs:
    """One scrape's inputs, changed step by step."""

    manifests: list[Manifest]
    running: dict[str, int]  # model -> running count on its page; a model missing: its page is down
    used: list[int]  # per GPU
    cap: SeriesCap = NO_CAP

    def render(
        self, cache: DeclaredCache, declarations: DeclarationFamilies | None, exposition: Exposition
    ) -> list[bytes]:
        entries = assess([(f"/m/{i:03}.json", m) for i, m in enumerate(self.manifests)], OTHER_NS)
        pages = [
            PageResult(f"http://{model}/metrics", scan_page(vllm_page_with(count, model)), None, 0.0)
            for model, count in sorted(self.running.items())
        ]
        devices = tuple(
            GpuMemory(i, gpu_uuid(i), "test GPU", 80 * GIB, used, 80 * GIB - used) for i, used in enumerate(self.used)
        )
        gpu = GpuResult(True, "nvml", devices, {i: {4242: GIB} for i in range(len(devices))})
        snap = build_snapshot(entries, pages, gpu, cap=self.cap, taken_at=NOW, cache=cache)
        metrics = families(snap, declarations)
        pages_out = [exposition.render(metrics, content_type) for content_type in FORMATS]
        assert all(page is not None for page in pages_out)
        return pages_out  # type: ignore[return-value]


def _observed(m: Manifest, bytes_held: int) -> Manifest:
    owners = tuple(OwnerObservation(d.owner, bytes_held, 1) for d in m.declarations[:1])
    return dataclasses.replace(m, observation=Observation(ObservationState.OK, "", 10.0, NOW - 1, 0.001, owners))


def _one(inputs: Inputs, at: int, change: Callable[[Manifest], Manifest]) -> None:
    if inputs.manifests:
        at %= len(inputs.manifests)
        inputs.manifests[at] = change(inputs.manifests[at])


CHANGES: dict[str, Callable[[Inputs, int], None]] = {
    "running count": lambda i, n: i.running.update({QWEN3_TTS.model_name: n % 300}),
    "engine down": lambda i, n: i.running.pop(MODELS[n % 3].model_name, None),
    "engine up": lambda i, n: i.running.update({MODELS[n % 3].model_name: n % 7}),
    "GPU used": lambda i, n: i.used.__setitem__(n % len(i.used), (40 + n % 40) * GIB),
    "re-read unchanged": lambda i, n: _one(i, n, lambda m: dataclasses.replace(m)),
    "rewritten with a new time": lambda i, n: _one(i, n, lambda m: dataclasses.replace(m, written_at=NOW + n)),
    "observation": lambda i, n: _one(i, n, lambda m: _observed(m, n * 1024)),
    "max_num_seqs": lambda i, n: _one(i, n, lambda m: dataclasses.replace(m, max_num_seqs=1 + n % 512)),
    "moved GPU": lambda i, n: _one(
        i, n, lambda m: dataclasses.replace(m, device=DeviceInfo(kind="cuda", index=n % 3, uuid=gpu_uuid(n % 3)))
    ),
    "GPU by index only": lambda i, n: _one(
        i, n, lambda m: dataclasses.replace(m, device=DeviceInfo(kind="cuda", index=n % 3))
    ),
    "pod": lambda i, n: _one(i, n, lambda m: dataclasses.replace(m, pod=PodInfo(name=f"pod-{n}", namespace="ns"))),
    "declarations": lambda i, n: _one(i, n, lambda m: dataclasses.replace(m, declarations=m.declarations[: 1 + n % 3])),
    "added": lambda i, n: i.manifests.append(reference_manifest(MODELS[n % 3], gpu=n % 3, stage=n % 2)),
    "rank on the same GPU": lambda i, n: _one(
        i, n, lambda m: dataclasses.replace(m, engine=dataclasses.replace(m.engine, tp_rank=1 + n % 2))
    ),
    "removed": lambda i, n: i.manifests.pop(n % len(i.manifests)) if i.manifests else None,
    "series cap": lambda i, n: setattr(i, "cap", SeriesCap(100 + 40 * (n % 10), 1 << 20) if n % 2 else NO_CAP),
}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(sorted(CHANGES)), st.integers(0, 1000)), min_size=1, max_size=12))
def test_reused_parts_render_as_a_fresh_build(steps: list[tuple[str, int]]) -> None:
    inputs = Inputs(
        [reference_manifest(m, gpu=g) for m in MODELS for g in range(2)], {QWEN3_TTS.model_name: 3}, [60 * GIB] * 3
    )
    cache, declarations, exposition = DeclaredCache(), DeclarationFamilies(), Exposition()
    inputs.render(cache, declarations, exposition)
    for name, n in steps:
        CHANGES[name](inputs, n)
        reused = inputs.render(cache, declarations, exposition)
        fresh = inputs.render(DeclaredCache(), None, Exposition())
        assert reused == fresh, f"after {name} ({n})"


def test_unchanged_declarations_are_reused_through_a_rewrite() -> None:
    """A worker rewriting its manifest with a new observation changes none of what is reused: the same objects
    come back, down to the frozen families (else the reuse above would hold only while nothing is written)."""
    inputs = Inputs([reference_manifest(m) for m in MODELS], {QWEN3_TTS.model_name: 3}, [60 * GIB])
    cache, declarations = DeclaredCache(), DeclarationFamilies()
    entries = assess([(f"/m/{i}.json", m) for i, m in enumerate(inputs.manifests)], OTHER_NS)
    gpu = GpuResult(True, "nvml", (GpuMemory(0, gpu_uuid(0), "test GPU", 80 * GIB, 60 * GIB, 20 * GIB),))
    first = build_snapshot(entries, [], gpu, cache=cache)
    rewritten = [dataclasses.replace(e, manifest=_observed(e.manifest, 1)) for e in entries if e.manifest]
    second = build_snapshot(rewritten, [], gpu, cache=cache)
    assert second.declared is first.declared
    assert families(second, declarations)[0] is families(first, declarations)[0]
    moved = [
        dataclasses.replace(e, manifest=dataclasses.replace(e.manifest, max_num_seqs=8))
        for e in rewritten
        if e.manifest
    ]
    assert build_snapshot(moved, [], gpu, cache=cache).declared is not first.declared
