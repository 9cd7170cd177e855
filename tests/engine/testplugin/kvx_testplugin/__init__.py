"""Test-only vLLM general plugin (see model.py and observed.py)."""

from __future__ import annotations


def register() -> None:
    # Lazy string form: vLLM imports the model module only where the model is built.
    from vllm import ModelRegistry

    from kvx_testplugin.geometry import ARCHITECTURE, OBSERVED_ARCHITECTURE

    for architecture, module in ((ARCHITECTURE, "model"), (OBSERVED_ARCHITECTURE, "observed")):
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, f"kvx_testplugin.{module}:{architecture}")
