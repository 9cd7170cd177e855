"""The public label sets of the exported families and the values they take (docs/CONTRACTS.md, metrics contract)."""

from __future__ import annotations

from kv_exporter.manifest import PodInfo
from kv_exporter.sidecar.engine_page import EngineKey

# The worker's pod, as kube-state-metrics and dcgm-exporter name it ("" outside Kubernetes).
POD_LABELS = ("pod", "namespace", "container")
DECLARATION_LABELS = ("model_name", "stage", "engine", "owner", "cache", "scope", "driver", "gpu", "UUID", *POD_LABELS)
INFO_EXTRA_LABELS = ("dtype", "capacity_source", "rows_fixed", "rows_reason", "allocation_note")
ENGINE_LABELS = ("model_name", "stage", "engine", *POD_LABELS)
OWNER_LABELS = ("model_name", "stage", "engine", "owner", "gpu", "UUID", *POD_LABELS)
ENGINE_GPU_LABELS = ("model_name", "stage", "engine", "gpu", "UUID", *POD_LABELS)
# A GPU's series carry the pod its engines run in (dcgm-exporter's labels), where they share one.
GPU_LABELS = ("gpu", "UUID", "source", *POD_LABELS)


def pod_labels(pod: PodInfo) -> tuple[str, str, str]:
    return (pod.name or "", pod.namespace or "", pod.container or "")


def engine_labels(key: EngineKey) -> tuple[str, str, str]:
    return (key.model_name, str(key.stage), str(key.engine))
