"""Manifests built through the real types (kv_exporter.manifest), and what the sidecar should make of them."""

from __future__ import annotations

import dataclasses
from typing import Any

from kv_exporter.document import NAME_MAX_CHARS, PROSE_MAX_CHARS
from kv_exporter.manifest import Declaration, DeviceInfo, EngineIdentity, Manifest, Phase, PodInfo, ProcessInfo
from kv_exporter.protocol import ModelLocalKVScope, RowDriver
from kv_exporter.reference import QWEN3_TTS, REFERENCE_MODELS, ReferenceModel
from tests.support.constants import gpu_uuid

MODEL = QWEN3_TTS.model_name  # the reference model that `live_manifest` declares by default


def reference_manifest(
    model: ReferenceModel = REFERENCE_MODELS[0],
    *,
    max_num_seqs: int = 256,
    gpu: int = 0,
    pid: int = 4242,
    phase: Phase = Phase.WARMUP,
    stage: int = 0,
    engine_index: int = 0,
) -> Manifest:
    """A reference model's manifest from a process on another host (pid 4242 in the host's pid namespace)."""
    return Manifest(
        engine=EngineIdentity(model_name=model.model_name, stage=stage, engine_index=engine_index),
        process=ProcessInfo(pid=pid, start_time_ticks=1000, pid_namespace="pid:[4026531836]", hostname="node-a"),
        device=DeviceInfo(kind="cuda", index=gpu, uuid=gpu_uuid(gpu)),
        max_num_seqs=max_num_seqs,
        phase=phase,
        collector="kv_exporter",
        declarations=tuple(Declaration.from_spec(owner, spec) for owner, spec in model.declarations),
        written_at=1_764_480_000.0,
    )


def live_manifest(model: ReferenceModel = QWEN3_TTS, process: ProcessInfo | None = None, **kwargs: Any) -> Manifest:
    """A reference manifest of a process that is alive (by default this test process, in this pid namespace: the
    sidecar checks it in /proc), on no recorded GPU, so that a lone simulated GPU stands in for it."""
    manifest = reference_manifest(model, **kwargs)
    return dataclasses.replace(manifest, process=process or ProcessInfo.current(), device=DeviceInfo(kind="cpu"))


def ceiling_bytes(manifest: Manifest) -> int:
    return sum(d.peak_bytes(manifest.max_num_seqs) for d in manifest.declarations)


def estimated_bytes(manifest: Manifest, running: int | None) -> int:
    """What the sidecar should estimate at `running` (None: engine unreadable, max_num_seqs rows fall back to 0)."""
    rows = 0 if running is None else min(running, manifest.max_num_seqs)
    return sum(d.bytes_per_row * d.rows_at(rows) for d in manifest.declarations)


def huge_manifest(n: int) -> Manifest:
    """A live manifest as large as a declarer can make one: 256 declarations, every string at its limit (256
    characters a name, 1,024 a prose field), just under the 1 MiB file cap."""
    declaration = Declaration(
        owner="o" * NAME_MAX_CHARS, name="", layers=1, kv_heads=1, head_dim=1, dtype="float16",
        physical_capacity_positions=1, capacity_source="c" * PROSE_MAX_CHARS, scope=ModelLocalKVScope.REQUEST,
        rows=RowDriver.FIXED, rows_fixed=1, rows_reason="r" * PROSE_MAX_CHARS, allocation_note="a" * PROSE_MAX_CHARS,
    )  # fmt: skip
    declarations = tuple(
        dataclasses.replace(declaration, name=f"{i:03d}".ljust(NAME_MAX_CHARS, "n")) for i in range(256)
    )
    big = "p" * NAME_MAX_CHARS
    manifest = dataclasses.replace(live_manifest(), declarations=declarations, pod=PodInfo(big, big, big))
    return dataclasses.replace(
        manifest,
        engine=dataclasses.replace(manifest.engine, model_name=f"{n:04d}".ljust(NAME_MAX_CHARS, "m")),
        device=DeviceInfo(kind="cuda", uuid="G" * NAME_MAX_CHARS),
    )
