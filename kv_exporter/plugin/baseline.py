"""The worker's GPU memory at publish time, and the device's NVML index / UUID, through `kv_exporter.gpu`.

Nothing here may fail a model load: every NVML or torch problem leaves the figure absent (None) and is logged
once. The UUID is the link between CUDA and NVML: CUDA's default device order (FASTEST_FIRST) need not be
NVML's PCI order, so the device's NVML index is looked up by UUID wherever the UUID is known. NVML reports
host PIDs, so inside a container without the host's PID namespace our pid is not found and the per-process
figure stays absent.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any

from kv_exporter.gpu import GpuReader, reason_of, shared_reader
from kv_exporter.manifest import Baseline, DeviceInfo
from kv_exporter.plugin.identity import GPU_UUID_PREFIX
from kv_exporter.plugin.oncelog import warn_once


def complete_device(reader: GpuReader, device: DeviceInfo) -> DeviceInfo:
    """NVML's index for a full-GPU UUID (CUDA allows unique prefixes), or the UUID for a bare index.

    A MIG id keeps index None: NVML lists MIG instances under their parent, not by index.
    """
    if device.uuid is not None and device.uuid.startswith(GPU_UUID_PREFIX):
        matches = [gpu.index for gpu in reader.scan().devices if gpu.uuid.startswith(device.uuid)]
        if len(matches) == 1:
            return replace(device, index=matches[0])
        return device
    if device.uuid is None and device.index is not None:
        return replace(device, uuid=reader.device(device.index).uuid)
    return device


def torch_reserved(runner: Any) -> int | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():  # torch would answer 0 for a device it never touched
            return None
        return int(torch.cuda.memory_reserved(getattr(runner, "device", None)))
    except Exception as exc:
        warn_once("torch-reserved", "kv-exporter: torch cannot report reserved memory (%r)", exc)
        return None


def measure(runner: Any, device: DeviceInfo, reader: GpuReader | None = None) -> tuple[DeviceInfo, Baseline]:
    """The completed device and the baseline; a CPU (or unknown) device has neither figure."""
    if device.kind != "cuda":
        return device, Baseline()
    used = None
    try:
        reader = reader or shared_reader()
        device = complete_device(reader, device)
        if device.index is not None:
            used = reader.process_memory(device.index).get(os.getpid())
    except Exception as exc:
        warn_once(
            "nvml",
            "kv-exporter: NVML unavailable (%s); the manifest's NVML baseline (and maybe GPU index/UUID) is empty",
            getattr(exc, "reason", None) or reason_of(exc),
        )
    return device, Baseline(nvml_process_used_bytes=used, torch_reserved_bytes=torch_reserved(runner))
