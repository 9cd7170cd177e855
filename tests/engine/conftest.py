"""Engine tests: a real vLLM 0.32 CPU engine in .venv-vllm (built by `make engine-env`), driven from .venv."""

from __future__ import annotations

import importlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.engine.server import VLLM_PYTHON, Server, start_server
from tests.engine.testplugin.kvx_testplugin import EXPECT_KV_EXPORTER_UNDER_ENV, ORIGIN_MODULES
from tests.engine.tinymodel import build_model
from tests.openai_server import mark_real_engine_tests

NO_ENGINE_ENV = "no .venv-vllm (run `make engine-env` / scripts/ensure-vllm-env.sh to build it)"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_real_engine_tests(items, Path(__file__).parent, pytest.mark.engine, VLLM_PYTHON.exists(), NO_ENGINE_ENV)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny random Qwen2 checkpoint + tokenizer for the whole session."""
    return build_model(tmp_path_factory.mktemp("kvx-tiny-model"))


ServerFactory = Callable[..., Server]


@pytest.fixture(scope="class")
def server_factory(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerFactory]:
    """Starts servers that are stopped (process group, by pid) when the class ends, pass or fail."""
    started: list[Server] = []

    def factory(name: str, **kwargs: object) -> Server:
        server = start_server(tmp_path_factory.mktemp(name), model_dir, **kwargs)  # type: ignore[arg-type]
        started.append(server)
        server.wait_ready()
        return server

    yield factory
    for server in started:
        server.stop()


def run_in_vllm_venv(code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run Python `code` in .venv-vllm; fails the test with its output when it exits non-zero."""
    result = subprocess.run(
        [str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}")
    return result


@pytest.fixture(scope="session", autouse=True)
def kv_exporter_under_test() -> None:
    """Where scripts/wheel-check.sh runs these tests on an installed wheel: this process's kv_exporter and both of its
    C extensions are the wheel's too (the engine's processes check theirs in kvx_testplugin)."""
    expected = os.environ.get(EXPECT_KV_EXPORTER_UNDER_ENV)
    if not expected:
        return
    for name in ORIGIN_MODULES:
        file = Path(str(importlib.import_module(name).__file__)).resolve()
        assert file.is_relative_to(Path(expected).resolve()), f"{name} from {file}, not under {expected}"
