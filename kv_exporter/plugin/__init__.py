"""The vLLM general plugin ("the hook"): publishes each worker's model-local KV declarations as a manifest.

vLLM calls `register()` in every process it starts (API server, engine core, workers). It only installs an
import hook: the runner and worker modules are patched when a process imports them, which only processes
that load a model do. Importing this package imports neither torch nor vllm.

It also patches transformers' cache base class when a process imports it, to observe the live caches
(`observe`); KV_EXPORTER_OBSERVE_INTERVAL=0 leaves it alone.

Environment: KV_EXPORTER_DISABLE=1 turns the hook off; KV_EXPORTER_DIR names the manifest folder (default
/run/kv-exporter, see `settings`); KV_EXPORTER_COLLECTOR=auto|vllm_omni|kv_exporter picks the collector;
KV_EXPORTER_OBSERVE_INTERVAL is the seconds between two observations (default 10, 0: off); KV_EXPORTER_STEP_RECORD=0
writes no step record (`steps`: each step's sequences beside the manifest, what the sidecar reads as running).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kv_exporter.plugin import observe
from kv_exporter.plugin.extensions import report_missing
from kv_exporter.plugin.hooks import MethodHook, install_on_module, install_post_import
from kv_exporter.plugin.oncelog import warn_once
from kv_exporter.plugin.settings import HookSettings

__all__ = ["HOOKS", "register"]

LOAD_METHOD = "load_model"
WARMUP_METHOD = "compile_or_warm_up_model"
# vLLM 0.34's extensible KV cache: sized at the end of warm-up, its pages committed by this call on every worker
# after warm-up returns (EngineCore), so the warm-up manifest is written when it returns instead.
EXTEND_METHOD = "extend_kv_cache"


def _on_load(runner: Any) -> None:
    from kv_exporter.manifest import Phase
    from kv_exporter.plugin.publish import publish

    publish(runner, Phase.LOAD)


def _on_warmup(worker: Any) -> None:
    if extends_after_warmup(worker):
        return  # what warm-up left is not final yet: published by _on_extend
    _publish_warm(worker)


def _on_extend(worker: Any) -> None:
    _publish_warm(worker)


def extends_after_warmup(worker: Any) -> bool:
    """Whether the engine commits the worker's KV cache after warm-up (vLLM 0.34's extensible KV cache)."""
    cache = getattr(worker, "cache_config", None)
    return getattr(cache, "enable_extensible_kv_cache", None) is True and callable(getattr(worker, EXTEND_METHOD, None))


def _publish_warm(worker: Any) -> None:
    from kv_exporter.manifest import Phase
    from kv_exporter.plugin.publish import publish

    runner = getattr(worker, "model_runner", None)
    if runner is None:
        warn_once("no-runner", "kv-exporter: %s has no model_runner; no warm-up manifest", type(worker).__name__)
        return
    publish(runner, Phase.WARMUP)


def _runner(module: str, *classes: str) -> MethodHook:
    return MethodHook(module, classes, LOAD_METHOD, _on_load)


def _worker(module: str, *classes: str) -> MethodHook:
    return MethodHook(module, classes, WARMUP_METHOD, _on_warmup)


def _extending_worker(module: str, *classes: str) -> MethodHook:
    return MethodHook(module, classes, EXTEND_METHOD, _on_extend)


# Base classes per module. Their subclasses (vllm-omni's GPUARModelRunner, GPUGenerationWorker, ...) are
# wrapped from the bases' __init__, so listing vllm-omni's own base is belt and braces, not a requirement.
HOOKS: tuple[MethodHook, ...] = (
    _runner("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    # Model Runner V2: a separate class tree, vLLM 0.32's default on GPUs with Triton (VLLM_USE_V2_MODEL_RUNNER) and
    # vLLM 0.34's only runner (the V1 modules are gone); its CPU runners (0.34: vllm.v1.worker.cpu.model_runner) and
    # multimodal-encoder runners subclass it, and are hooked from its __init__.
    _runner("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
    # vLLM 0.34's runner for CPUs without Triton other than x86: its own class tree, loading without super().
    _runner("vllm.v1.worker.cpu.standalone_model_runner", "StandaloneCPUModelRunner"),
    # Overrides load_model without calling super(): wrapping only GPUModelRunner would never fire on CPU.
    _runner("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    _runner("vllm_omni.worker.gpu_model_runner", "OmniGPUModelRunner"),
    # vllm-omni's Model Runner V2 family (OmniARModelRunner, OmniGenerationModelRunner): its load_model calls
    # super() and then keeps setting up, so the outermost call publishes after it.
    _runner("vllm_omni.worker_v2.omni_model_runner", "OmniGPUModelRunner"),
    _worker("vllm.v1.worker.gpu_worker", "Worker"),
    _extending_worker("vllm.v1.worker.gpu_worker", "Worker"),
    _worker("vllm.v1.worker.cpu_worker", "CPUWorker"),
    _worker("vllm_omni.worker.base", "OmniGPUWorkerBase"),
)

_registered = False


def _patcher(module_name: str) -> Any:
    hooks = [hook for hook in HOOKS if hook.module == module_name]

    def patch(module: ModuleType) -> None:
        install_on_module(module, hooks)

    return patch


def register() -> None:
    """Idempotent and cheap; does nothing under KV_EXPORTER_DISABLE=1. Never raises into vLLM: a C extension the
    settings need that does not load is logged as an error (extensions.py)."""
    global _registered
    if _registered:
        return
    try:
        settings = HookSettings.from_environ()
        if settings.disabled:
            return
        _registered = True
        report_missing(settings)
        patches = {hook.module: _patcher(hook.module) for hook in HOOKS}
        install_post_import(patches | observe.patches(settings))
    except Exception as exc:
        warn_once("register", "kv-exporter: plugin registration failed (%r); vLLM runs without it", exc)
