"""The reason lists every error counter is exported at 0 for are complete: every reason the source can raise is in its
list (found in the source, so a new reason without its zero fails here), and the NVML list matches the binding."""

from __future__ import annotations

import re
from pathlib import Path

import pynvml
import pytest

from kv_exporter.gpu import NVML_ERROR_REASONS, reason_of
from kv_exporter.manifest import OBSERVATION_PROBLEM_REASONS, READER_ERROR_REASONS
from kv_exporter.sidecar.engine_page import PAGE_ERROR_REASONS
from kv_exporter.sidecar.inputs import MANIFEST_ERROR_REASONS, OBSERVATION_ERROR_REASONS
from kv_exporter.transport import fetch
from kv_exporter.transport.fetch import FETCH_ERROR_REASONS

PACKAGE = Path(__file__).resolve().parents[2] / "kv_exporter"
SOURCE = {path: path.read_text() for path in PACKAGE.rglob("*.py")}


def raised(error: str, *, after_path: bool = False) -> set[str]:
    """The literal reasons passed to `error(...)` anywhere in the package (after its path argument, if it has one)."""
    path = r"[\w.]+,\s*" if after_path else ""
    pattern = re.compile(rf"\b{error}\(\s*{path}\"([a-z_]+)\"")
    return {reason for text in SOURCE.values() for reason in pattern.findall(text)}


def fetch_reasons_raised() -> set[str]:
    """The reasons `fetch` raises: it names them by constant."""
    names = set(re.findall(r"\bFetchError\(\s*([A-Z_]+),", SOURCE[PACKAGE / "transport" / "fetch.py"]))
    return {getattr(fetch, name) for name in names}


@pytest.mark.parametrize(
    ("found", "listed"),
    [
        (raised("DocumentError") - {"duplicate_owner"}, READER_ERROR_REASONS),
        ({"duplicate_owner"} & raised("DocumentError"), OBSERVATION_PROBLEM_REASONS),
        (raised("ManifestError", after_path=True), READER_ERROR_REASONS),
        (raised("EnginePageError"), PAGE_ERROR_REASONS),
        (fetch_reasons_raised(), FETCH_ERROR_REASONS),
        (raised("GpuReadError"), NVML_ERROR_REASONS),
    ],
    ids=["document", "observation", "manifest", "page", "fetch", "gpu"],
)
def test_every_reason_raised_is_listed(found: set[str], listed: tuple[str, ...]) -> None:
    assert found, "the pattern found nothing: it no longer matches the source"
    assert found <= set(listed), found - set(listed)
    assert len(set(listed)) == len(listed)


def test_the_sidecar_lists_hold_the_readers_lists() -> None:
    assert set(READER_ERROR_REASONS) < set(MANIFEST_ERROR_REASONS)
    assert set(OBSERVATION_PROBLEM_REASONS) < set(OBSERVATION_ERROR_REASONS)
    assert set(FETCH_ERROR_REASONS) < set(PAGE_ERROR_REASONS)


def test_the_nvml_reasons_are_the_bindings_error_classes() -> None:
    classes = {getattr(pynvml, name) for name in dir(pynvml) if name.startswith("NVMLError_")}
    assert {reason_of(cls()) for cls in classes} | {"binding_missing"} == set(NVML_ERROR_REASONS)
