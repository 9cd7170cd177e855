#!/bin/sh
# install-sidecar.sh SRC PREFIX WHEELS   (REVISION=<git commit> in the environment, optional)
# Builds kv-exporter's wheel from the source tree SRC into WHEELS and installs it, with the sidecar's extras
# (NVML, TLS/basic auth), into a new virtual environment at PREFIX. The Dockerfile runs exactly this; so does
# tests/deploy/test_dockerfile.py. The sidecar needs neither torch nor vllm: the script fails if either
# arrives.
set -eu
src=$1
prefix=$2
wheels=$3
python=${PYTHON:-python3}

# The source revision (the Dockerfile's REVISION build argument) goes into the package: an image has no git
# checkout for --version and the build-info metric to read it from.
if [ -n "${REVISION:-}" ] && [ "$REVISION" != unknown ]; then
    printf '%s\n' "$REVISION" >"$src/kv_exporter/REVISION"
fi

"$python" -m pip wheel --no-cache-dir --no-deps --wheel-dir "$wheels" "$src"
wheel=$(ls "$wheels"/kv_exporter-*.whl)
"$python" -m venv "$prefix"
"$prefix/bin/python" -m pip install --no-cache-dir --no-compile "${wheel}[nvml,web]"
# Byte-compile now: a read-only root filesystem cannot take .pyc files at run time.
"$prefix/bin/python" -m compileall -q "$prefix/lib"
"$prefix/bin/python" - <<'PY'
import importlib.util
import sys

present = [name for name in ("torch", "vllm", "transformers") if importlib.util.find_spec(name)]
sys.exit(f"install-sidecar: the sidecar must not ship {present}" if present else 0)
PY
"$prefix/bin/kv-exporter" --help >/dev/null
