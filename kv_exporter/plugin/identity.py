"""Who is publishing: engine identity and ranks, the device, max_num_seqs -- read from a live model runner.

Everything is read duck-typed from the runner's configs so that vLLM's and vllm-omni's runners (and their
version drift) are handled alike; torch and vllm are used only where already imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv_exporter.manifest import DeviceInfo, EngineIdentity, PodInfo
from kv_exporter.plugin.oncelog import warn_once

# Set by vllm-omni 0.30 in each stage engine-core process (stage_engine_core_proc.py) and inherited by its
# workers; it is the `replica` label of vllm-omni's per-stage metrics.
ENV_OMNI_REPLICA = "VLLM_OMNI_REPLICA_ID"
ENV_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
# Set by the deploy manifests: the pod's name and namespace from the downward API, the container's name as written
# (Kubernetes has no field reference for it). They join the figures to kube-state-metrics' and dcgm-exporter's.
ENV_POD_NAME = "KV_EXPORTER_POD_NAME"
ENV_POD_NAMESPACE = "KV_EXPORTER_POD_NAMESPACE"
ENV_CONTAINER_NAME = "KV_EXPORTER_CONTAINER_NAME"
GPU_UUID_PREFIX = "GPU-"


def _config(runner: Any, name: str) -> Any:
    value = getattr(runner, name, None)
    if value is None:
        value = getattr(getattr(runner, "vllm_config", None), name, None)
    return value


def _int_or(value: object, default: int) -> int:
    if isinstance(value, bool):
        return default
    try:
        return int(value)  # type: ignore[call-overload, no-any-return]
    except (TypeError, ValueError):
        return default


def served_model_name(model_config: Any) -> str:
    """The `model_name` label vLLM puts on its metrics: the first served name, else the model path."""
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    name = served or getattr(model_config, "model", None)
    return str(name) if name else "unknown"


def max_num_seqs(runner: Any) -> int:
    scheduler = _config(runner, "scheduler_config")
    value = getattr(scheduler, "max_num_seqs", None)
    if value is None:
        value = getattr(runner, "max_num_reqs", None)
    return max(1, _int_or(value, 1))


def omni_replica(environ: dict[str, str] | os._Environ[str] | None = None) -> int | None:
    env = os.environ if environ is None else environ
    text = env.get(ENV_OMNI_REPLICA)
    if text is None:
        return None
    value = _int_or(text.strip(), -1)
    return value if value >= 0 else None


def pod_info(environ: Mapping[str, str] | None = None) -> PodInfo:
    """The pod, namespace and container the deploy manifests put in the environment; None where unset or blank."""
    env = os.environ if environ is None else environ

    def read(name: str) -> str | None:
        return env.get(name, "").strip() or None

    return PodInfo(name=read(ENV_POD_NAME), namespace=read(ENV_POD_NAMESPACE), container=read(ENV_CONTAINER_NAME))


def engine_identity(runner: Any) -> EngineIdentity:
    model_config = _config(runner, "model_config")
    parallel = _config(runner, "parallel_config")
    dp_rank = max(0, _int_or(getattr(parallel, "data_parallel_rank", 0), 0))
    # vLLM labels metrics with the DP engine index; dense models reset data_parallel_rank to 0 but keep the index.
    dp_index = max(0, _int_or(getattr(parallel, "data_parallel_index", dp_rank), dp_rank))
    replica = omni_replica()
    tp_rank, pp_rank = parallel_ranks(parallel)
    return EngineIdentity(
        model_name=served_model_name(model_config),
        stage=max(0, _int_or(getattr(model_config, "stage_id", 0), 0)),
        engine_index=dp_index if replica is None else replica,
        data_parallel_rank=dp_rank,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
    )


def parallel_ranks(parallel: Any) -> tuple[int, int]:
    """(TP rank, PP rank) from vLLM's initialised process groups; 0 where the group size is 1."""
    tp_size = _int_or(getattr(parallel, "tensor_parallel_size", 1), 1)
    pp_size = _int_or(getattr(parallel, "pipeline_parallel_size", 1), 1)
    state = sys.modules.get("vllm.distributed.parallel_state")
    tp_rank = pp_rank = 0
    if state is None:
        if tp_size > 1 or pp_size > 1:
            warn_once("ranks", "kv-exporter: vLLM's parallel state is not loaded; TP/PP ranks recorded as 0")
        return tp_rank, pp_rank
    try:
        if tp_size > 1:
            tp_rank = int(state.get_tensor_model_parallel_rank())
        if pp_size > 1:
            pp_rank = int(state.get_pp_group().rank_in_group)
    except Exception as exc:
        warn_once("ranks", "kv-exporter: cannot read TP/PP ranks (%r); recorded as 0", exc)
    return tp_rank, pp_rank


@dataclass(frozen=True)
class VisibleDevice:
    """What CUDA_VISIBLE_DEVICES says a visible ordinal is: a physical index or a GPU / MIG UUID."""

    index: int | None = None
    uuid: str | None = None


def parse_visible_devices(text: str | None) -> list[VisibleDevice] | None:
    """The visible list as CUDA reads it; None when the variable is unset (every device, in order).

    CUDA stops at the first entry it cannot parse (so "0,-1,2" makes only device 0 visible); an entry is a
    non-negative index, a "GPU-..." UUID or a "MIG-..." id.
    """
    if text is None:
        return None
    devices: list[VisibleDevice] = []
    for raw in text.split(","):
        entry = raw.strip()
        if entry.isdigit():
            devices.append(VisibleDevice(index=int(entry)))
        elif entry.startswith(("GPU-", "MIG-")):
            devices.append(VisibleDevice(uuid=entry))
        else:
            break
    return devices


def map_visible_ordinal(ordinal: int, visible: str | None) -> VisibleDevice:
    """The physical device behind visible ordinal `ordinal` (torch's cuda:N)."""
    devices = parse_visible_devices(visible)
    if devices is None:
        return VisibleDevice(index=ordinal)
    if 0 <= ordinal < len(devices):
        return devices[ordinal]
    return VisibleDevice()


def visible_device(device: object) -> tuple[str, int | None]:
    """A worker's torch device: its kind ("cuda", "cpu", "unknown") and, on CUDA, its visible ordinal (torch's
    cuda:N; where the device names none, the calling thread's current device: call it from the worker's thread)."""
    kind = str(getattr(device, "type", None) or device or "unknown")
    if kind != "cuda":
        return kind, None
    ordinal = getattr(device, "index", None)
    return kind, _current_cuda_ordinal() if ordinal is None else int(ordinal)


def device_info(runner: Any) -> DeviceInfo:
    kind, ordinal = visible_device(getattr(runner, "device", None))
    if ordinal is None:
        return DeviceInfo(kind=kind)
    mapped = map_visible_ordinal(int(ordinal), os.environ.get(ENV_VISIBLE_DEVICES))
    # torch knows the visible device's UUID whatever CUDA_VISIBLE_DEVICES holds; the NVML index follows from it.
    return DeviceInfo(kind=kind, index=mapped.index, uuid=mapped.uuid or torch_uuid(int(ordinal)))


def torch_uuid(ordinal: int) -> str | None:
    """The visible device's UUID as torch reports it (spelled as NVML spells it), or None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        uuid = getattr(torch.cuda.get_device_properties(ordinal), "uuid", None)
    except Exception:
        return None
    if not uuid:
        return None
    text = str(uuid)
    return text if text.startswith(GPU_UUID_PREFIX) else GPU_UUID_PREFIX + text


def _current_cuda_ordinal() -> int | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:  # not before CUDA is initialised: asking would initialise device 0, which need not be the worker's
        return int(torch.cuda.current_device()) if torch.cuda.is_initialized() else None
    except Exception:
        return None
