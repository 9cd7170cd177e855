"""Which collector the hook uses, with a vllm_omni package written to disk (its __init__ fails, as the real
one does against vLLM 0.32). The real wheel is exercised in tests/engine/test_upstream_interop.py."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch import nn

from kv_exporter.plugin import collect
from kv_exporter.protocol import ModelLocalKVScope, ModelLocalKVSpec, RowDriver
from tests.support.plugin_state import forget_upstream_collector, forget_warnings

UPSTREAM_SOURCE = textwrap.dedent(
    """
    from __future__ import annotations
    from dataclasses import dataclass
    import logging

    MARK = "upstream"

    def collect_model_local_kv_specs(model):
        return [("upstream-walk", spec) for _, module in model.named_modules()
                for spec in getattr(module, "model_local_kv_specs", lambda: [])()]
    """
)


class Owner(nn.Module):
    def model_local_kv_specs(self) -> list[ModelLocalKVSpec]:
        return [
            ModelLocalKVSpec(
                name="c",
                layers=1,
                kv_heads=1,
                head_dim=8,
                dtype="float32",
                physical_capacity_positions=4,
                capacity_source="test",
                scope=ModelLocalKVScope.MODEL,
                rows=RowDriver.MAX_NUM_SEQS,
            )
        ]


def model() -> nn.Module:
    root = nn.Module()
    root.owner = Owner()
    return root


@pytest.fixture
def fake_wheel(tmp_path: Path) -> Iterator[Path]:
    """site-packages with a vllm_omni whose package __init__ raises, like the real one on vLLM 0.32."""
    package = tmp_path / "vllm_omni"
    (package / "model_executor" / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError(\"cannot import name 'RoutedExpertsLists'\")\n")
    sys.path.insert(0, str(tmp_path))
    forget_warnings()
    forget_upstream_collector()
    yield package / "model_executor" / "models" / "model_local_kv.py"
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("vllm_omni") or m == collect.PRIVATE_MODULE]:
        del sys.modules[name]
    forget_upstream_collector()


def test_without_vllm_omni_ours_is_used() -> None:
    forget_upstream_collector()
    name, pairs = collect.collect(model())
    assert name == "kv_exporter" and [owner for owner, _ in pairs] == ["owner"]


def test_the_wheel_file_is_loaded_by_path_without_running_the_package(fake_wheel: Path) -> None:
    fake_wheel.write_text(UPSTREAM_SOURCE)
    name, pairs = collect.collect(model())
    assert name == "vllm_omni" and [owner for owner, _ in pairs] == ["upstream-walk"]
    assert "vllm_omni" not in sys.modules  # the failing package __init__ never ran
    assert sys.modules[collect.PRIVATE_MODULE].MARK == "upstream"
    assert collect.collect(model(), "kv_exporter")[0] == "kv_exporter"  # KV_EXPORTER_COLLECTOR=kv_exporter


def test_a_file_with_other_imports_is_not_loaded(fake_wheel: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake_wheel.write_text("import subprocess\n" + UPSTREAM_SOURCE)
    assert collect.collect(model())[0] == "kv_exporter"
    assert collect.PRIVATE_MODULE not in sys.modules
    assert any("imports more than expected" in r.getMessage() for r in caplog.records)


def test_a_file_that_fails_to_load_falls_back(fake_wheel: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake_wheel.write_text("from typing import DoesNotExist\n")
    assert collect.collect(model())[0] == "kv_exporter"
    assert collect.PRIVATE_MODULE not in sys.modules
    assert any("collector unavailable" in r.getMessage() for r in caplog.records)


def test_an_already_imported_vllm_omni_is_used_as_is(fake_wheel: Path) -> None:
    fake_wheel.parent.parent.parent.joinpath("__init__.py").write_text("")  # a vllm-omni process: imports fine
    fake_wheel.write_text(UPSTREAM_SOURCE.replace('MARK = "upstream"', 'MARK = "imported"'))
    import vllm_omni  # noqa: F401  (what a vllm-omni worker has done long before the hook runs)

    assert collect.collect(model())[0] == "vllm_omni"
    assert sys.modules["vllm_omni.model_executor.models.model_local_kv"].MARK == "imported"
    assert collect.PRIVATE_MODULE not in sys.modules


@pytest.mark.parametrize(
    ("source", "safe"),
    [
        ("import torch\nfrom vllm.logger import init_logger\nfrom dataclasses import dataclass\n", True),
        ("from collections.abc import Sequence\nfrom typing import Protocol\n", True),
        ("import os\n", False),
        ("from vllm.config import VllmConfig\n", False),
        ("from . import sibling\n", False),
        ("def f():\n    import subprocess\n", False),  # nested imports count too
    ],
)
def test_imports_are_safe(source: str, safe: bool) -> None:
    assert collect.imports_are_safe(source) is safe
