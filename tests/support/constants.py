"""Facts the tests and the benchmarks share. Standard library only: the benchmarks' sidecar process imports this."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
# Set to 1 to rewrite the pages the real-engine tests record into FIXTURES (then review the diff).
UPDATE_FIXTURES_ENV = "KV_EXPORTER_UPDATE_FIXTURES"
GIB = 1 << 30
MIB = 1 << 20
QWEN_ROW = 4_653_056  # bytes per row of Qwen3-TTS's codec decoder caches (design notes: 4.44 MiB per request)

# The simulated GPU most tests give the sidecar: 80 GiB, 60 GiB of them used (by vLLM's own allocations).
GPU_TOTAL = 80 * GIB
GPU_USED = 60 * GIB
SIMULATE_GPU = ("--simulate-gpu", f"{GPU_TOTAL}:{GPU_USED}")

# A pid namespace no test manifest is in: liveness falls back to the newest-incarnation rule.
OTHER_NS = "pid:[1]"


def gpu_uuid(index: int) -> str:
    """The UUID that test manifests record for GPU `index`, and that simulated GPUs report."""
    return f"GPU-{index:08d}-0000-0000-0000-000000000000"


UUID0 = gpu_uuid(0)
