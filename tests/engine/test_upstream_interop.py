"""vllm-omni 0.30's own protocol module, loaded by file path in .venv-vllm, against kv_exporter's readers.

The design notes' four models are rebuilt as REAL upstream `ModelLocalKVSpec`s (torch dtypes, upstream enums)
and hung on a real `nn.Module` tree at their owner paths. kv_exporter must accept them unchanged: the manifest's
`Declaration.from_spec`, our collector and the hook's collector choice must give exactly what upstream's own
methods and collector give.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kv_exporter.reference import QWEN3_TTS, REFERENCE_MODELS
from tests.engine.conftest import run_in_vllm_venv

SEQS = (0, 1, 2, 8, 256)
QWEN3_TTS_CODEC_BYTES_PER_ROW = 4_653_056  # design notes: 4.44 MiB per request

SCRIPT = r"""
import importlib.util, json, sys
from pathlib import Path
import torch
from torch import nn

# The upstream module, by file path from the installed wheel (its package __init__ fails on vLLM 0.32).
package = importlib.util.find_spec("vllm_omni")
path = Path(package.submodule_search_locations[0], "model_executor", "models", "model_local_kv.py")
spec = importlib.util.spec_from_file_location("upstream_model_local_kv", path)
upstream = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = upstream
spec.loader.exec_module(upstream)

from kv_exporter.manifest import Declaration
from kv_exporter.plugin import collect as hook_collect
from kv_exporter.protocol import collect_model_local_kv_specs as ours_collect
from kv_exporter.reference import REFERENCE_MODELS

SEQS = json.loads(sys.argv[1])


def upstream_spec(ref):
    return upstream.ModelLocalKVSpec(
        name=ref.name, layers=ref.layers, kv_heads=ref.kv_heads, head_dim=ref.head_dim,
        dtype=getattr(torch, ref.dtype), physical_capacity_positions=ref.physical_capacity_positions,
        capacity_source=ref.capacity_source, scope=upstream.ModelLocalKVScope(ref.scope.value),
        rows=upstream.RowDriver(ref.rows.value), rows_fixed=ref.rows_fixed, rows_reason=ref.rows_reason,
        allocation_note=ref.allocation_note,
    )


class Owner(nn.Module):
    def __init__(self):
        super().__init__()
        self.specs = []

    def model_local_kv_specs(self):
        return list(self.specs)


class GraphWrapper:
    # Like vLLM's CUDAGraphWrapper: not a Module, forwards attributes, has unwrap().
    def __init__(self, runnable):
        self.runnable = runnable

    def unwrap(self):
        return self.runnable

    def __getattr__(self, name):
        return getattr(self.runnable, name)


def tree_for(model):
    root = nn.Module()
    for owner_path, ref in model.declarations:
        node = root
        for part in owner_path.split("."):
            if not hasattr(node, part):
                node.add_module(part, Owner())
            node = getattr(node, part)
        node.specs.append(upstream_spec(ref))
    return root


def sizes(obj):
    return {
        "bytes_per_row": obj.bytes_per_row,
        "row_count": [obj.row_count(n) for n in SEQS],
        "peak_bytes": [obj.peak_bytes(n) for n in SEQS],
    }


def fields(obj):
    return {
        "name": obj.name, "layers": obj.layers, "kv_heads": obj.kv_heads, "head_dim": obj.head_dim,
        "dtype": str(obj.dtype).removeprefix("torch."), "positions": obj.physical_capacity_positions,
        "capacity_source": obj.capacity_source, "scope": getattr(obj.scope, "value", obj.scope),
        "rows": getattr(obj.rows, "value", obj.rows), "rows_fixed": obj.rows_fixed, "rows_reason": obj.rows_reason,
        "allocation_note": obj.allocation_note,
    }


def pairs(collected):
    return [(path, id(spec)) for path, spec in collected]


out = {"upstream_file": str(path), "models": {}}
for model in REFERENCE_MODELS:
    tree = tree_for(model)
    wrapped = GraphWrapper(tree)
    upstream_pairs = upstream.collect_model_local_kv_specs(tree)
    hook_auto = hook_collect.collect(wrapped)
    hook_ours = hook_collect.collect(wrapped, "kv_exporter")
    out["models"][model.model_name] = {
        "specs": [
            {"owner": owner, "upstream": {**sizes(spec), **fields(spec)},
             "declaration": {**sizes(Declaration.from_spec(owner, spec)), **fields(Declaration.from_spec(owner, spec))}}
            for owner, spec in upstream_pairs
        ],
        "upstream_pairs": pairs(upstream_pairs),
        "upstream_pairs_via_wrapper": pairs(upstream.collect_model_local_kv_specs(wrapped)),
        "ours_pairs": pairs(ours_collect(tree)),
        "ours_pairs_via_wrapper": pairs(ours_collect(wrapped)),
        "hook_auto": [hook_auto[0], pairs(hook_auto[1])],
        "hook_ours": [hook_ours[0], pairs(hook_ours[1])],
        "manifest_declarations": len(hook_collect.to_declarations(hook_auto[1])),
    }
loaded = hook_collect.upstream_collector()
out["hook_loaded_file"] = loaded.__code__.co_filename
out["vllm_omni_imported"] = "vllm_omni" in sys.modules
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def interop() -> dict[str, Any]:
    result = run_in_vllm_venv(f"import sys; sys.argv = ['x', {json.dumps(json.dumps(SEQS))}]\n" + SCRIPT)
    [line] = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    data: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return data


def test_every_reference_declaration_matches_upstream_to_the_byte(interop: dict[str, Any]) -> None:
    for model in REFERENCE_MODELS:
        specs = interop["models"][model.model_name]["specs"]
        assert [(s["owner"], s["upstream"]["name"]) for s in specs] == [
            (owner, ref.name) for owner, ref in model.declarations
        ]
        for spec in specs:
            assert spec["declaration"] == spec["upstream"]


def test_qwen3_tts_codec_decoder_figure(interop: dict[str, Any]) -> None:
    [owner, ref] = QWEN3_TTS.declarations[0]
    specs = interop["models"]["Qwen3-TTS"]["specs"]
    [spec] = [s for s in specs if (s["owner"], s["upstream"]["name"]) == (owner, ref.name)]
    assert spec["upstream"]["bytes_per_row"] == spec["declaration"]["bytes_per_row"] == QWEN3_TTS_CODEC_BYTES_PER_ROW
    # rows: max(1, max_num_seqs), as upstream counts them
    assert spec["declaration"]["row_count"] == [max(1, n) for n in SEQS]


def test_collectors_agree_and_count_each_owner_once(interop: dict[str, Any]) -> None:
    for model in REFERENCE_MODELS:
        result = interop["models"][model.model_name]
        upstream = result["upstream_pairs"]
        assert len(upstream) == len(model.declarations)
        assert result["upstream_pairs_via_wrapper"] == upstream
        assert result["ours_pairs"] == upstream
        assert result["ours_pairs_via_wrapper"] == upstream
        assert result["hook_auto"] == ["vllm_omni", upstream]
        assert result["hook_ours"] == ["kv_exporter", upstream]
        assert result["manifest_declarations"] == len(model.declarations)


def test_the_hook_loads_the_wheel_file_without_importing_the_package(interop: dict[str, Any]) -> None:
    assert interop["hook_loaded_file"] == interop["upstream_file"]
    assert interop["upstream_file"].endswith("vllm_omni/model_executor/models/model_local_kv.py")
    assert interop["vllm_omni_imported"] is False
