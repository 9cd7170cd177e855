#!/bin/sh
# install-plugin.sh WHEELS
# Adds the kv-exporter vLLM plugin to the Python environment of an upstream vLLM (or vllm-omni) image, without
# touching vLLM's own pins (--no-deps: its one dependency, prometheus-client, already comes with vLLM). Then
# checks that vLLM will find it (entry point group vllm.general_plugins).
set -eu
wheels=$1
python=${PYTHON:-python3}

"$python" -m pip install --no-cache-dir --no-deps "$(ls "$wheels"/kv_exporter-*.whl)"
"$python" - <<'PY'
import sys
from importlib.metadata import entry_points

names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
sys.exit(0 if "kv_exporter" in names else f"install-plugin: kv_exporter not among vLLM plugins {names}")
PY
