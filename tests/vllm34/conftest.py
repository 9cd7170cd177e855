"""vLLM 0.34 tests: its real runner and worker classes in .venv-vllm34 (built by `make vllm34-env`), no engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.openai_server import mark_real_engine_tests
from tests.support.constants import REPO

VLLM34_PYTHON = REPO / ".venv-vllm34" / "bin" / "python"
MISSING = "no .venv-vllm34 (run `make vllm34-env` / scripts/ensure-vllm34-env.sh to build it)"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_real_engine_tests(items, Path(__file__).parent, pytest.mark.vllm34, VLLM34_PYTHON.exists(), MISSING)
