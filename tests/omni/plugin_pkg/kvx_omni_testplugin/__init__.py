"""Test-only plugins that let vllm-omni 0.30 serve a tiny Qwen2 on a CPU-only machine.

Installed only into .venv-omni by scripts/ensure-omni-env.sh; never part of kv-exporter's runtime code.
See docs/vllm-omni.md for why each piece exists.
"""
