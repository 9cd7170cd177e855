"""vllm-omni tests: a real `vllm-omni serve --omni` in .venv-omni (built by `make omni-env`), driven from .venv."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.omni.omni_server import (
    NO_OMNI_ENV,
    OMNI_STAMP,
    OmniServer,
    build_model,
    start_server,
)
from tests.openai_server import mark_real_engine_tests
from tests.support.sidecar import Sidecar
from tests.support.sidecar import sidecar as sidecar_process


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_real_engine_tests(items, Path(__file__).parent, pytest.mark.omni, OMNI_STAMP.exists(), NO_OMNI_ENV)


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OmniServer]:
    """One server for the module, stopped by pid when the module ends, pass or fail."""
    workdir = tmp_path_factory.mktemp("omni")
    model_dir = build_model(workdir / "kvx-omni-tiny")
    server = start_server(workdir, model_dir, workdir / "manifests")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def sidecar(omni: OmniServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """`kv-exporter serve` from this (torch-free) venv, reading the server's manifests and page."""
    args = ("--manifest-dir", str(omni.manifest_dir), "--engine-url", omni.url("/metrics"), "--no-nvml")
    with sidecar_process(tmp_path_factory.mktemp("sidecar"), *args) as running:
        yield running
