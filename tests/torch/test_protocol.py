"""The declaration protocol on torch's own objects: its dtypes, and a real module tree (the rest of the protocol,
torch-free: tests/unit/test_protocol.py)."""

from __future__ import annotations

import torch

from kv_exporter.protocol import ModelLocalKVSpec, collect_model_local_kv_specs
from tests.support.specs import make_spec


def test_torch_dtype_and_name_agree() -> None:
    for name in ("float32", "bfloat16", "float16"):
        assert make_spec(dtype=getattr(torch, name)).bytes_per_row == make_spec(dtype=name).bytes_per_row


def test_real_torch_modules_are_walked() -> None:
    class Owner(torch.nn.Module):
        def model_local_kv_specs(self) -> list[ModelLocalKVSpec]:
            return [make_spec()]

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(Owner()))
    assert [path for path, _ in collect_model_local_kv_specs(model)] == ["1.0"]
