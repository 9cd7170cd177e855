"""``vllm_omni.platform_plugins`` entry point.

Kept free of heavy imports: vllm-omni calls it while resolving ``current_omni_platform`` and resolves the
returned qualified name afterwards.
"""

from __future__ import annotations

from types import ModuleType


def _register_pipeline(_registry: ModuleType) -> None:
    from kvx_omni_testplugin.pipeline import register

    register()


def platform_plugin() -> str:
    # vllm-omni 0.30 loads `vllm_omni.general_plugins` only after `vllm-omni serve` has resolved the model
    # to a pipeline (prepare_engine_environment, OmniEngineArgs.__post_init__, the worker mixin), so a
    # pipeline registered by a general plugin alone is not found by the API server. Platform plugins are
    # resolved first in every process: register the pipeline as soon as the pipeline registry is imported.
    from kvx_omni_testplugin.guards import after_import

    after_import("vllm_omni.config.pipeline_registry", _register_pipeline)
    # vllm-omni has no CPU OmniPlatform; without one it falls back to UnspecifiedOmniPlatform, which reports
    # zero devices and no AR worker. This test venv is CPU-only, so the plugin is always active.
    return "kvx_omni_testplugin.cpu_platform.KvxCpuOmniPlatform"
