"""Manifests built through the real writer path, shared by tests."""

from __future__ import annotations

from kv_exporter.manifest import Declaration, DeviceInfo, EngineIdentity, Manifest, Phase, ProcessInfo
from kv_exporter.reference import REFERENCE_MODELS, ReferenceModel


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
    return Manifest(
        engine=EngineIdentity(model_name=model.model_name, stage=stage, engine_index=engine_index),
        process=ProcessInfo(pid=pid, start_time_ticks=1000, pid_namespace="pid:[4026531836]", hostname="node-a"),
        device=DeviceInfo(kind="cuda", index=gpu, uuid=f"GPU-{gpu:08d}-0000-0000-0000-000000000000"),
        max_num_seqs=max_num_seqs,
        phase=phase,
        collector="kv_exporter",
        declarations=tuple(Declaration.from_spec(owner, spec) for owner, spec in model.declarations),
        written_at=1_764_480_000.0,
    )
