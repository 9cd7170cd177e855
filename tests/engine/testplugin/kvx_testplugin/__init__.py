"""Test-only vLLM general plugin (see model.py)."""

from __future__ import annotations


def register() -> None:
    # Lazy string form: vLLM imports the model module only where the model is built.
    from vllm import ModelRegistry

    from kvx_testplugin.geometry import ARCHITECTURE

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"kvx_testplugin.model:{ARCHITECTURE}")
