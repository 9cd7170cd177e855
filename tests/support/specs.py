"""A declaration spec with test defaults, any field overridden (the protocol's tests, with and without torch)."""

from __future__ import annotations

from kv_exporter.protocol import ModelLocalKVScope, ModelLocalKVSpec, RowDriver


def make_spec(**overrides: object) -> ModelLocalKVSpec:
    fields: dict[str, object] = {
        "name": "c",
        "layers": 2,
        "kv_heads": 2,
        "head_dim": 32,
        "dtype": "float32",
        "physical_capacity_positions": 10,
        "capacity_source": "test",
        "scope": ModelLocalKVScope.REQUEST,
        "rows": RowDriver.MAX_NUM_SEQS,
    }
    fields.update(overrides)
    return ModelLocalKVSpec(**fields)  # type: ignore[arg-type]
