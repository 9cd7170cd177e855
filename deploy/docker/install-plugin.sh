#!/bin/sh
# install-plugin.sh SRC
# Adds the kv-exporter vLLM plugin to the Python environment of an upstream vLLM (or vllm-omni) image, without
# touching vLLM's own pins (--no-deps: its one dependency, prometheus-client, already comes with vLLM). It builds
# from the source tree SRC with the image's own Python, because the plugin's cache tracker and its step record's
# writer are C extensions (kv_exporter.plugin.observe._tracker, kv_exporter.plugin._steps) that must match that
# interpreter. Then checks that vLLM will find the plugin (entry point group vllm.general_plugins) and that both
# import (`python -m kv_exporter.plugin --check`, kv_exporter/plugin/extensions.py): without them the worker reports
# its observation unavailable ("not-built") and keeps no step record, so an image without them is refused here
# rather than found out in a metric.
set -eu
src=$1
python=${PYTHON:-python3}

"$python" -m pip install --no-cache-dir --no-deps "$src"
# From /, so that the installed package is checked, not a source tree in the working directory.
(cd / && "$python" -m kv_exporter.plugin --check)
