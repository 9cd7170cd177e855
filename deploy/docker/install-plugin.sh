#!/bin/sh
# install-plugin.sh SRC
# Adds the kv-exporter vLLM plugin to the Python environment of an upstream vLLM (or vllm-omni) image, without
# touching vLLM's own pins (--no-deps: its one dependency, prometheus-client, already comes with vLLM). It builds
# from the source tree SRC with the image's own Python, because the plugin's cache tracker and its step record's
# writer are C extensions (kv_exporter.plugin.observe._tracker, kv_exporter.plugin._steps) that must match that
# interpreter. Then checks that vLLM will find the plugin (entry point group vllm.general_plugins) and that both
# import: without them the worker reports its observation unavailable ("not-built") and keeps no step record, so an
# image without them is refused here rather than found out in a metric.
set -eu
src=$1
python=${PYTHON:-python3}

"$python" -m pip install --no-cache-dir --no-deps "$src"
"$python" - <<'PY'
import sys
from importlib.metadata import entry_points

names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
if "kv_exporter" not in names:
    sys.exit(f"install-plugin: kv_exporter not among vLLM plugins {names}")
try:
    import kv_exporter.plugin._steps  # noqa: F401
    import kv_exporter.plugin.observe._tracker  # noqa: F401
except ImportError as error:
    sys.exit(
        f"install-plugin: kv-exporter's C extensions did not build ({error}): this image needs a C compiler and "
        "its Python's headers (Debian/Ubuntu: gcc and python3-dev, or the python3.X-dev of its interpreter) "
        "before this step"
    )
PY
