"""A CPU OmniPlatform: vllm-omni's OmniPlatform interface on top of vLLM's CpuPlatform."""

from __future__ import annotations

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

WORKER_CLS = "kvx_omni_testplugin.worker.KvxCPUARWorker"


class KvxCpuOmniPlatform(OmniPlatform, CpuPlatform):
    """OmniPlatform's device hooks raise NotImplementedError, and OmniPlatform comes first in the MRO,
    so each hook vllm-omni calls on the AR path is answered here for the host CPU (one "device")."""

    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return WORKER_CLS

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        raise NotImplementedError("the CPU test platform only runs LLM_AR stages")

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return int(psutil.virtual_memory().total)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
