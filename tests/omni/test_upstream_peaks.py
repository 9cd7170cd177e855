"""vllm-omni 0.30's own MiMo-Audio classes on CPU, in .venv-omni: the peak between samples and attribution that
cannot mask, through the real manifest and the sidecar's real reader and snapshot.

`MiMoAudioLLMForConditionalGeneration` declares its local transformer's decode cache. Its `input_local_transformer`
(a `MiMoAudioQwen2Model`, transformers' Qwen2Model with `use_cache` on by default) declares nothing, yet builds a
`DynamicCache` on every call of the real `apply_input_local_transformer`, and drops it when the call returns. The
two configs share KV heads, head size and dtype (`input_local_dim` defaults to `local_dim`) and differ in layers.
The root is built from a small random config the way FIELD-NOTES describes (`__new__`, `nn.Module.__init__`, the
attributes its real `__init__` sets that the two methods read): the real `__init__` builds vLLM parallel layers.

Expected bytes are an independent count from the geometry: K and V of every layer of the input local config, its
KV heads x head size, `group_size` positions, one row per group of the batch, bf16.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.omni.omni_server import OMNI_PYTHON

SCRIPT = r"""
import json, os, sys, time
os.environ["KV_EXPORTER_OBSERVE_INTERVAL"] = "1"
import torch
from kv_exporter.plugin import observe
from kv_exporter.plugin.hooks import install_post_import
from kv_exporter.plugin.settings import HookSettings
install_post_import(observe.patches(HookSettings.from_environ()))
import transformers.cache_utils  # the hook patches the cache classes as transformers defines them
from vllm_omni.model_executor.models.mimo_audio.config_mimo_audio import MiMoAudioConfig
from vllm_omni.model_executor.models.mimo_audio.mimo_audio_llm import (
    MiMoAudioLLMForConditionalGeneration, MiMoAudioQwen2Model)
from kv_exporter.manifest import DeviceInfo, EngineIdentity, Manifest, Phase, ProcessInfo, write_manifest
from kv_exporter.plugin.collect import COLLECTOR_OURS, collect, to_declarations
from kv_exporter.sidecar.inputs import ManifestStore, assess
from kv_exporter.sidecar.records import GpuResult
from kv_exporter.sidecar.snapshot import build_snapshot

torch.manual_seed(0)
config = MiMoAudioConfig(
    vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, group_size=4, audio_channels=2, delay_pattern="0-1",
    speech_vocab_size="17-17", speech_zeroemb_idx="16-16", local_dim=64, local_layers=3, local_attn_heads=4,
    local_ffn_dim=128, input_local_layers=2, input_full_attention=True)
root = MiMoAudioLLMForConditionalGeneration.__new__(MiMoAudioLLMForConditionalGeneration)
torch.nn.Module.__init__(root)
root.config = config
root.group_size, root.delay_pattern = config.group_size, config.parsed_delay_pattern()
root.local_config, root.input_local_config = config.local_config(), config.input_local_config()
root.input_local_transformer = MiMoAudioQwen2Model(root.input_local_config).to(torch.bfloat16).eval()
root.input_local_transformer.embed_tokens = None
root.local_transformer = MiMoAudioQwen2Model(root.local_config).to(torch.bfloat16).eval()
root.local_transformer.embed_tokens = None
root.local_forward_cg_by_bs = {}

_, pairs = collect(root, COLLECTOR_OURS)
declarations = to_declarations(pairs)
observe.attach(root, declarations, torch.device("cpu"))
observe.observe(pause=lambda: None)  # the interval starts here

layers = root.input_local_config.num_hidden_layers
heads = root.input_local_config.num_key_value_heads
head_dim = root.input_local_config.head_dim
def expected(batch, groups):
    return 2 * layers * heads * head_dim * config.group_size * batch * groups * 2
steps = [(1, 3), (2, 5), (1, 2)]  # several steps inside one interval, the largest in the middle
with torch.no_grad():
    for batch, groups in steps:
        root.apply_input_local_transformer(torch.randn(batch, groups, config.group_size, 64, dtype=torch.bfloat16))
sample = observe.observe(pause=lambda: None)

manifest = Manifest(
    engine=EngineIdentity(model_name="mimo-audio-tiny"),
    process=ProcessInfo.current(),
    device=DeviceInfo(kind="cpu"),
    max_num_seqs=4,
    phase=Phase.WARMUP,
    collector=COLLECTOR_OURS,
    declarations=declarations,
    observation=sample,
)
folder = sys.argv[1]
write_manifest(folder, manifest)
entries = assess(ManifestStore(folder).load(), None)
snapshot = build_snapshot(entries, [], GpuResult(False, None), taken_at=time.time())
print("RESULT " + json.dumps({
    "expected_peak": max(expected(b, g) for b, g in steps),
    "declared_owners": sorted({d.owner for d in declarations}),
    "sample": {o.owner: [o.bytes, o.caches, o.peak_bytes] for o in sample.owners},
    "views": {v.owner: [v.observed_bytes, v.peak_bytes, v.ceiling_bytes, v.unexplained_bytes, v.declares]
              for v in snapshot.observed.owners},
}))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("mimo")
    process = subprocess.run(
        [str(OMNI_PYTHON), "-c", SCRIPT, str(folder)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=Path(__file__).resolve().parents[2],  # this checkout's kv_exporter, ahead of the installed one
    )
    assert process.returncode == 0, process.stderr[-4000:]
    (line,) = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    parsed: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return parsed


def test_mimo_s_input_local_transformer_cache_is_its_own_at_its_peak(result: dict[str, Any]) -> None:
    assert result["declared_owners"] == [""]  # the root declares; input_local_transformer declares nothing
    sample = result["sample"]
    # made and freed inside each call: nothing at the sample, the biggest call's cache at the peak, to the byte
    assert sample["input_local_transformer"] == [0, 0, result["expected_peak"]]
    assert sample[""] == [0, 0, 0]  # not hidden under the declaring root


def test_the_sidecar_exports_all_of_its_peak_as_unexplained(result: dict[str, Any]) -> None:
    observed, peak, ceiling, unexplained, declares = result["views"]["input_local_transformer"]
    assert (observed, peak, ceiling, declares) == (0, result["expected_peak"], 0, False)
    assert unexplained == max(0, peak - ceiling) == peak
    root = result["views"][""]
    assert root[3] == 0 and root[2] > 0  # the root's own declaration explains everything it holds (nothing)
