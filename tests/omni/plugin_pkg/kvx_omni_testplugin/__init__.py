"""Test-only plugins that let vllm-omni 0.30 and 0.32.0rc1 serve a tiny Qwen2 on a CPU-only machine.

Installed only into .venv-omni and .venv-omni32 (scripts/ensure-omni-env.sh, scripts/ensure-omni32-env.sh); never
part of kv-exporter's runtime code. The same code serves both releases. See docs/vllm-omni.md for why each piece
exists.
"""
