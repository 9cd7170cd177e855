"""The declaration protocol: semantics from vllm-omni's design notes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kv_exporter.protocol import (
    HasModelLocalKV,
    ModelLocalKVScope,
    ModelLocalKVSpec,
    RowDriver,
    collect_model_local_kv_specs,
    spec_from_hf_config,
)
from tests.support.specs import make_spec


def test_bytes_per_row_is_k_and_v_over_every_dimension() -> None:
    spec = make_spec(layers=3, kv_heads=5, head_dim=7, physical_capacity_positions=11, dtype="bfloat16")
    assert spec.bytes_per_row == 2 * 3 * 5 * 7 * 11 * 2


def test_row_count_follows_the_driver_not_the_scope() -> None:
    per_seq = make_spec(scope=ModelLocalKVScope.MODEL, rows=RowDriver.MAX_NUM_SEQS)
    fixed = make_spec(scope=ModelLocalKVScope.REQUEST, rows=RowDriver.FIXED, rows_fixed=3, rows_reason="3 buckets")
    assert per_seq.row_count(256) == 256
    assert per_seq.row_count(0) == 1  # vllm-omni's max(1, max_num_seqs)
    assert fixed.row_count(256) == 3
    assert fixed.peak_bytes(256) == 3 * fixed.bytes_per_row


def test_rows_has_no_default() -> None:
    with pytest.raises(TypeError):
        ModelLocalKVSpec("c", 1, 1, 32, "float32", 1, "x", ModelLocalKVScope.MODEL)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        spec_from_hf_config(  # type: ignore[call-arg]
            SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=32),
            name="c",
            physical_capacity_positions=1,
            capacity_source="x",
            scope=ModelLocalKVScope.MODEL,
            dtype="float32",
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rows": RowDriver.FIXED, "rows_fixed": 2, "rows_reason": "  "}, "rows_reason"),
        ({"rows": RowDriver.FIXED, "rows_fixed": 0, "rows_reason": "why"}, "rows_fixed"),
        ({"layers": 0}, "layers"),
        ({"head_dim": -1}, "head_dim"),
        ({"physical_capacity_positions": True}, "physical_capacity_positions"),
        ({"dtype": "complex64"}, "dtype"),
        ({"name": " "}, "name"),
        ({"scope": "forever"}, "forever"),
        ({"rows": "max_num_sessions"}, "max_num_sessions"),
    ],
)
def test_invalid_specs_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_spec(**overrides)


def test_strings_are_coerced_to_enums() -> None:
    spec = make_spec(scope="session", rows="fixed", rows_fixed=1, rows_reason="one per session")
    assert spec.scope is ModelLocalKVScope.SESSION
    assert spec.rows is RowDriver.FIXED


def hf_config(**attrs: object) -> SimpleNamespace:
    return SimpleNamespace(**attrs)


def from_config(config: object, **overrides: object) -> ModelLocalKVSpec:
    return spec_from_hf_config(
        config,
        name="c",
        physical_capacity_positions=5,
        capacity_source="t",
        scope=ModelLocalKVScope.REQUEST,
        dtype="float32",
        rows=RowDriver.MAX_NUM_SEQS,
        **overrides,  # type: ignore[arg-type]
    )


def test_spec_from_hf_config_reads_the_geometry() -> None:
    spec = from_config(hf_config(num_hidden_layers=4, num_key_value_heads=2, num_attention_heads=8, hidden_size=256))
    assert (spec.layers, spec.kv_heads, spec.head_dim) == (4, 2, 32)
    whisper = from_config(hf_config(encoder_layers=6, encoder_attention_heads=8, d_model=512))
    assert (whisper.layers, whisper.kv_heads, whisper.head_dim) == (6, 8, 64)
    explicit = from_config(hf_config(num_hidden_layers=4, num_key_value_heads=2, head_dim=48, hidden_size=256))
    assert explicit.head_dim == 48


def test_spec_from_hf_config_raises_rather_than_guessing() -> None:
    with pytest.raises(ValueError, match="layer count"):
        from_config(hf_config(num_key_value_heads=2, head_dim=32))
    with pytest.raises(ValueError, match="hidden size"):
        from_config(hf_config(num_hidden_layers=2, num_key_value_heads=2))


def test_spec_from_hf_config_overrides_win() -> None:
    spec = from_config(hf_config(), layers=3, kv_heads=1, head_dim=64)
    assert (spec.layers, spec.kv_heads, spec.head_dim) == (3, 1, 64)


class Module:
    """Just enough of nn.Module's `named_modules()` for the walk (real torch modules are tested elsewhere)."""

    def __init__(self, **children: Module) -> None:
        self.children = children

    def named_modules(self, prefix: str = "") -> list[tuple[str, Module]]:
        found: list[tuple[str, Module]] = [(prefix, self)]
        for name, child in self.children.items():
            found.extend(child.named_modules(f"{prefix}.{name}" if prefix else name))
        return found


class Declarer(Module):
    def __init__(self, *specs: ModelLocalKVSpec, **children: Module) -> None:
        super().__init__(**children)
        self.specs = specs

    def model_local_kv_specs(self) -> tuple[ModelLocalKVSpec, ...]:
        return self.specs


class Raising(Module):
    def model_local_kv_specs(self) -> list[ModelLocalKVSpec]:
        raise RuntimeError("cache not built")


class GraphWrapper:
    """Like vLLM's CUDAGraphWrapper: not a module, forwards attribute access, and offers unwrap()."""

    def __init__(self, runnable: object) -> None:
        self.runnable = runnable

    def unwrap(self) -> object:
        return self.runnable

    def __getattr__(self, name: str) -> object:
        return getattr(self.runnable, name)


def test_collector_walks_the_tree_and_reports_owner_paths() -> None:
    a, b = make_spec(name="a"), make_spec(name="b")
    model = Module(talker=Module(codec=Declarer(a, b)), other=Module())
    assert isinstance(model.children["talker"].children["codec"], HasModelLocalKV)
    assert collect_model_local_kv_specs(model) == [("talker.codec", a), ("talker.codec", b)]


def test_wrapper_does_not_double_a_root_level_declarer() -> None:
    spec = make_spec()
    assert collect_model_local_kv_specs(GraphWrapper(Declarer(spec))) == [("", spec)]


def test_shared_submodule_counted_once() -> None:
    spec = make_spec()
    shared = Declarer(spec)
    model = Module(a=shared, b=shared)
    assert collect_model_local_kv_specs(model) == [("a", spec)]


def test_raising_declaration_is_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    spec = make_spec()
    errors: list[str] = []
    model = Module(bad=Raising(), good=Declarer(spec))
    with caplog.at_level(logging.WARNING):
        result = collect_model_local_kv_specs(model, on_error=lambda path, exc: errors.append(path))
    assert result == [("good", spec)]
    assert errors == ["bad"]
    assert "cache not built" in caplog.text


def test_declaring_nothing_is_valid() -> None:
    assert collect_model_local_kv_specs(Module(a=Declarer())) == []
    assert collect_model_local_kv_specs(object()) == []
