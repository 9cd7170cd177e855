"""vllm-omni tests: a real `vllm-omni serve --omni` of each release in its own venv (built by `make omni-env` and
`make omni32-env`), driven from .venv. The server tests run once per release (the `release` fixture)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.omni.omni_server import OMNI_030, RELEASES, OmniServer, Release, build_model, start_server
from tests.support.sidecar import Sidecar
from tests.support.sidecar import sidecar as sidecar_process

HERE = Path(__file__).parent


def item_release(item: pytest.Item) -> Release:
    """The release a test runs against: its `release` parameter, else its module's RELEASE (default 0.30)."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "release" in callspec.params:
        release: Release = callspec.params["release"]
        return release
    return getattr(getattr(item, "module", None), "RELEASE", OMNI_030)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.omni)
            release = item_release(item)
            if not release.stamp.exists():
                item.add_marker(pytest.mark.skip(reason=release.missing))


@pytest.fixture(scope="module", params=RELEASES, ids=[r.version for r in RELEASES])
def release(request: pytest.FixtureRequest) -> Release:
    param: Release = request.param
    return param


@pytest.fixture(scope="module")
def omni(release: Release, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OmniServer]:
    """One server per release for the module, stopped by pid when its tests end, pass or fail."""
    workdir = tmp_path_factory.mktemp(f"omni-{release.version}")
    model_dir = build_model(release, workdir / "kvx-omni-tiny")
    server = start_server(release, workdir, model_dir, workdir / "manifests")
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
