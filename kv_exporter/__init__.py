"""kv-exporter: live metrics for attention KV kept outside vLLM's paged KV manager.

Importing this package must stay cheap and must never import torch or vllm: the sidecar imports it, and vLLM
imports it in every process through the general-plugin entry point.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "register"]


def register() -> None:
    """vLLM general-plugin entry point (`vllm.general_plugins`); see `kv_exporter.plugin`."""
    from kv_exporter.plugin import register as _register

    _register()
