"""The corpus for issue 39's "no false KV": every module of vllm-omni 0.30.0 and 0.32.0rc1 that declares model-local
KV, and the model roots holding them, built from tiny configs on CPU as upstream builds them, observed idle and after
a step, under the state rule (kv_exporter/plugin/observe/holders.py, `kv_evidence`) and every other rule beside the
transformers caches (the known classes). What kv-exporter counts must be K/V and all of the K/V alive, to the byte,
against an independent count (kvx_omni_testplugin.corpus). The same corpus under the rules the state rule replaced
(a declared dtype and a whole number of KV vectors; a declared dtype alone) must fail: MiMo-Audio's root holds
staging buffers those rules take for KV.

The declaring classes (`grep -rn "def model_local_kv_specs"` over each wheel's vllm_omni/model_executor/models), and
how each is built here (cases of kvx_omni_testplugin.corpus):
- MiMoAudioLLMForConditionalGeneration (mimo_audio/mimo_audio_llm.py; a root; both releases): its real `__init__`
  on a real VllmConfig with a one-process gloo group (vLLM's Qwen2 inside; `_audio_embeds_buffer`,
  `_attention_mask_buffer` and `_new_audio_emb_buffer` registered). `mimo`: as a CPU builds it (no graph bucket),
  idle and after eager `apply_input_local_transformer` and `local_forward`. `mimo_graph_buffers`: idle, with every
  bucket's real MiMoLocalDecodeBuffer and MiMoInputLocalTransformerBuffer and a graph object holding the output its
  capture returns, as a GPU's `__init__` keeps them (no graph is captured: that needs CUDA).
- Qwen3TTSTokenizerV2Decoder (qwen3_tts/tokenizer_12hz/) in the root Qwen3TTSCode2Wav, and CUDAGraphDecoderWrapper
  (qwen3_tts/segmented_graph_wrapper.py; a plain object the decoder forwards; both releases): real `__init__` and
  `load_weights` from a written folder. `qwen3_tts_eager` (no wrapper: declares nothing) and `qwen3_tts_wrapper`
  (its real `enable_cudagraph`, every capture failing), idle and after async-chunk steps.
- MiniCPMWhisperEncoder (minicpmo_4_5/minicpmo_4_5_omni_llm.py; both releases): its real `__init__`; the thinker and
  the root MiniCPMO45OmniForConditionalGeneration `bare` (their real `__init__` builds the LLM by hub name).
  `minicpmo_030`: through the real duplex runtime, idle and after 4 chunks; `minicpmo_032` (0.32.0rc1's batched
  streaming sessions, a known class): idle.
- MingFlashOmniTalkerForConditionalGeneration (ming_flash_omni/ming_flash_omni_talker.py; a root) and
  MingAudioGenerator (talker_module.py; a plain object the root forwards): `ming_talker` on 0.30.0, the root `bare`
  with its real parts, idle and after 2 requests. Not built on 0.32.0rc1: its aggregator imports `x_transformers`,
  which .venv-omni32 does not install.
- VibeVoiceForConditionalGeneration (vibevoice/vibevoice.py; a root; 0.32.0rc1) and VibeVoiceNegativeKV
  (negative_kv.py; a plain object the root forwards): `vibevoice_032`, the root `bare` (its real `__init__` builds
  tokenizers and a diffusion head from a checkpoint) holding the real VibeVoiceNegativeKV with its pool laid out as
  `allocate` lays it out (`allocate` refuses a CPU); idle only (its forward needs FlashAttention 3).

Beside them, four raw K/V stores of modules that declare nothing (rule 3, kv_exporter/plugin/observe/raw_stores.py):
`fish_speech_fast_ar` and `audio8_fast_ar` (both releases), each FastAR predictor by its real `__init__` (vLLM
layers on a real VllmConfig, weights post-processed as vLLM's loader does) under a `bare` root of its real slow-AR
class, idle and after three forwards; `qwen3_code_predictor` (0.32.0rc1: 0.30.0's has no K/V path), Qwen3's fused
CodePredictorWrapper by its real `__init__` under a `bare` Qwen3-Omni talker root, its CUDA-only K/V path switched
on as a CUDA platform does, after its real `_ensure_buffers` (the K/V forward itself needs CUDA);
`qwen3_tts_frame_cache` (0.32.0rc1), Qwen3-TTS's talker code predictor by its real `__init__` under a `bare` talker
root, holding the real FrameLocalKVCache its `_setup_compile` keeps on CUDA with bf16 weights. Not built: the
per-layer stores rule 3 does not see: rule 4's (below).

Rule 4 (per-layer stores whose names say K/V, in heads the modules name; `kvx_omni_testplugin.store_cases`), each
module by its real `__init__` (tiny) under a `bare` root of its real model class, `RULE4_STORES` below: PersonaPlex's
mimi transformers (`streaming_init` as the codec's, per release), MOSS-TTS's audio tokenizers v1 and v2 (their real
`initialize_decoder_state_pool`), fish_speech's DAC window transformer (its real `setup_caches`, after load; neither
wheel calls it), and on 0.32.0rc1 fish_speech's DAC stream state (real DACStreamState and DACDecodeGraphs, its real
`kv` and `ring`) and Qwen3-TTS's StreamingCodecDecoder (at load, from the real tokenizer decoder). The harness also
observes each moment under rule 4 by shape alone and by names alone (`STORE_RULES`): both must fail.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kv_exporter.manifest import read_manifest
from kv_exporter.sidecar.liveness import State, Verdict
from kv_exporter.sidecar.observed import OwnerView
from kv_exporter.sidecar.observed import observe as sidecar_view
from kv_exporter.sidecar.records import GpuResult, ManifestEntry
from tests.omni.omni_server import CHECKOUT_PATHS, OMNI_030, OMNI_032, Release

PRODUCT_RULE = "kv_evidence"
LOOSER_RULES = ("whole_kv_vectors", "declared_dtype")
ALL = (OMNI_030.version, OMNI_032.version)
RAW_STORES = (
    ("fish_speech_fast_ar", "fast_ar"),
    ("audio8_fast_ar", "fast_ar"),
    ("qwen3_code_predictor", "code_predictor"),
    ("qwen3_tts_frame_cache", "code_predictor"),
)
COMMON = (
    "mimo",
    "mimo_graph_buffers",
    "qwen3_tts_eager",
    "qwen3_tts_wrapper",
    "minicpmo_030",
    "fish_speech_fast_ar",
    "audio8_fast_ar",
)
# Rule 4's stores: case -> (release -> the modules holding them), and their bytes at the cases' sizes, from their
# shapes as upstream's code lays them out (float32 unless said).
PERSONAPLEX_RING = 2 * 2 * 8 * 16 * 4  # [K and V, rows, 2 heads, context 8, head size 16], a row
RULE4_STORES: dict[str, dict[str, tuple[tuple[str, ...], int]]] = {
    "personaplex": {  # 2 layers a transformer; 0.30.0: both halves, 1 row; 0.32.0rc1: the decoder half, 3 rows
        OMNI_030.version: (("mimi.decoder_transformer", "mimi.encoder_transformer"), 2 * 2 * PERSONAPLEX_RING),
        OMNI_032.version: (("mimi.decoder_transformer",), 2 * 3 * PERSONAPLEX_RING),
    },
    "moss_v1": {  # [K and V, 2 + 1 slots, 2 heads, context 20, head size 8], one layer
        release: (("_codec.decoder.0.transformer.layers.0.attn",), 2 * 3 * 2 * 20 * 8 * 4) for release in ALL
    },
    "moss_v2": {
        release: (("_codec.decoder.0.transformer.layers.0.self_attn",), 2 * 3 * 2 * 20 * 8 * 4) for release in ALL
    },
    "fish_dac_kv_cache": {  # K and V [3 rows, 2 KV heads, 8 positions, head size 16] a layer, 2 layers
        release: (
            tuple(f"_codec.quantizer.post_module.layers.{i}.attention.kv_cache" for i in range(2)),
            2 * 2 * 3 * 2 * 8 * 16 * 4,
        )
        for release in ALL
    },
    "fish_dac_stream": {  # 2 layers: K and V [3 + 1 slots, window 8, 2 KV heads, 16] float32 and a bf16 ring
        OMNI_032.version: (("",), 2 * 2 * 4 * 8 * 2 * 16 * 4 + 2 * 2 * 4 * 2 * (8 + 4) * 16 * 2)
    },
    "qwen3_tts_stream_decoder": {  # 2 layers: K and V rings [4 + 1 slots, 128, 2 heads x 16] bf16
        OMNI_032.version: (("stream_decoder",), 2 * 2 * 5 * 128 * 32 * 2)
    },
}
CASES = {
    OMNI_030.version: (*COMMON, "ming_talker", *(c for c, r in RULE4_STORES.items() if OMNI_030.version in r)),
    OMNI_032.version: (
        *COMMON, "vibevoice_032", "minicpmo_032", "qwen3_code_predictor", "qwen3_tts_frame_cache",
        *(c for c, r in RULE4_STORES.items() if OMNI_032.version in r),
    ),
}  # fmt: skip
STORE_RULE = "named_kv"


@pytest.fixture(scope="module")
def corpus(release: Release, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every case of this release, one child process each (kvx_omni_testplugin.corpus): case -> its result."""
    out = tmp_path_factory.mktemp(f"corpus-{release.version}")
    env = {"PYTHONPATH": ":".join(map(str, CHECKOUT_PATHS)), "HOME": str(out), "VLLM_NO_USAGE_STATS": "1"}
    cases = CASES[release.version]
    command = [str(release.python), "-m", "kvx_omni_testplugin.corpus", str(out), *cases]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, check=False)
    results = {case: json.loads((out / f"{case}.json").read_text()) for case in cases}
    errors = {case: r["error"] for case, r in results.items() if "error" in r}
    assert done.returncode == 0 and not errors, (errors, done.stdout[-4000:], done.stderr[-4000:])
    return results


def violations(results: dict[str, dict[str, Any]], rule: str) -> list[str]:
    """Each case and moment where what kv-exporter observed under `rule` is not the K/V alive, to the byte."""
    found = []
    for case, result in results.items():
        for moment, figures in result["moments"].items():
            observed = figures["observed"][rule]
            if sum(observed.values()) != figures["truth"]["total"]:
                found.append(f"{case} {moment}: observed {observed}, K/V alive {figures['truth']}")
    return found


def test_what_is_counted_is_the_kv_alive_to_the_byte(corpus: dict[str, dict[str, Any]]) -> None:
    assert violations(corpus, PRODUCT_RULE) == []
    # The corpus holds K/V where it should (else the equality above would hold with nothing counted at all).
    alive = {(case, m): f["truth"]["total"] for case, r in corpus.items() for m, f in r["moments"].items()}
    assert alive[("minicpmo_030", "step")] > 0 and alive[("qwen3_tts_wrapper", "step")] > 0
    if "vibevoice_032" in corpus:
        assert alive[("vibevoice_032", "idle")] > 0 and alive[("minicpmo_032", "idle")] > 0
    # Rule 3 (raw stores of modules that declare nothing) looked at the corpus too: every module with an attention
    # config of its own (HF attention and MLP modules, MiMo's local transformers, Qwen3-TTS's pre-transformer).
    assert (
        len(corpus["mimo"]["rule3_modules"]) >= 10
        and "decoder.pre_transformer" in corpus["qwen3_tts_wrapper"]["rule3_modules"]
    )


def test_mimo_root_shows_nothing_with_no_cache_alive_its_buffers_built(corpus: dict[str, dict[str, Any]]) -> None:
    for case in ("mimo", "mimo_graph_buffers"):
        result = corpus[case]
        assert result["declared"] == {"": [[3, 4, 16, "bfloat16"]]}  # the local transformer's decode cache
        for moment, figures in result["moments"].items():
            assert figures["truth"]["total"] == 0, (case, moment)
            assert figures["observed"][PRODUCT_RULE] == {}, (case, moment)
            state = {s["path"]: s for s in figures["state"]}
            staging = state["_new_audio_emb_buffer"]  # [max batch 100, 1, group_size, input-local hidden]
            assert (staging["shape"], staging["dtype"], staging["bytes"]) == ([100, 1, 4, 64], "bfloat16", 51_200)
            assert not any(s["kv"] for s in figures["state"])
    graph_state = [s["path"] for s in corpus["mimo_graph_buffers"]["moments"]["idle"]["state"]]
    for held_by in ("local_forward_buf_by_bs", "input_local_transformer_buf_by_bs", "input_local_transformer_cg_by_bs"):
        assert sum(path.startswith(f"{held_by}[") for path in graph_state) >= 9  # every bucket's tensors


def test_the_state_rule_counts_only_kv_of_each_declaring_owners_state(corpus: dict[str, dict[str, Any]]) -> None:
    """Where an owner's state holds K/V beside other tensors (VibeVoice's pool beside its int32 block table), only
    the K/V is counted; every other tensor any declaring owner's state holds is not."""
    for case, result in corpus.items():
        for moment, figures in result["moments"].items():
            observed = figures["observed"][PRODUCT_RULE]
            for owner in {s["owner"] for s in figures["state"]}:
                kv_in_state = {s["path"]: s["bytes"] for s in figures["state"] if s["owner"] == owner and s["kv"]}
                assert observed.get(owner, 0) >= sum(kv_in_state.values()), (case, moment, owner)
    if "vibevoice_032" in corpus:
        [idle] = corpus["vibevoice_032"]["moments"].values()
        table = next(s for s in idle["state"] if s["path"] == "negative_kv._block_tables")
        assert not table["kv"] and idle["observed"][PRODUCT_RULE] == {"": idle["truth"]["raw"]}


@pytest.mark.parametrize("rule", LOOSER_RULES)
def test_the_corpus_fails_a_looser_state_rule(corpus: dict[str, dict[str, Any]], rule: str) -> None:
    """The negative corpus: the rules the state rule replaced take MiMo-Audio's staging buffers for KV, at least its
    `_new_audio_emb_buffer` (51,200 B here; 819,200 B at the checkpoints' sizes), idle and after a step."""
    found = violations(corpus, rule)
    assert any(v.startswith("mimo idle:") for v in found) and any(v.startswith("mimo step:") for v in found)
    assert any(v.startswith("mimo_graph_buffers idle:") for v in found)
    for case in ("mimo", "mimo_graph_buffers"):
        for figures in corpus[case]["moments"].values():
            assert figures["observed"][rule][""] >= 51_200


def views(path: str) -> dict[str, OwnerView]:
    """The sidecar's figures for a published manifest, read as its sample was taken."""
    manifest = read_manifest(Path(path))
    assert manifest.observation is not None
    entry = ManifestEntry(path, manifest, Verdict(State.LIVE, "test"))
    snapshot = sidecar_view([entry], {}, GpuResult(False, None), manifest.observation.taken_at)
    return {view.owner: view for view in snapshot.owners}


@pytest.mark.parametrize(("case", "owner"), RAW_STORES)
def test_a_raw_store_of_a_module_that_declares_nothing_is_its_own_unexplained_to_the_byte(
    corpus: dict[str, dict[str, Any]], case: str, owner: str
) -> None:
    """Rule 3: a fast-AR predictor's `_k_cache` / `_v_cache` (allocated by its first forward, regrown for a larger
    batch, kept between calls), the fused code predictor's `_kv_buf` and Qwen3-TTS's FrameLocalKVCache `buffer` are
    observed under the module that holds them, all unexplained; the buffers beside them (`_embed_buf`, `_proj_buf`,
    position ids) are not."""
    if case not in corpus:
        pytest.skip(f"{case}'s store is new in vllm-omni 0.32.0rc1")
    result = corpus[case]
    assert result["declared"] == {}
    idle, step = result["moments"]["idle"], result["moments"]["step"]
    assert idle["truth"]["total"] == 0 and idle["observed"][PRODUCT_RULE] == {}  # nothing before the first forward
    # [3 layers, 3 rows (the largest batch), 2 KV heads, 4 codebooks + 1, head size 16] float32, K and V
    assert step["truth"] == {"caches": 0, "raw": 2 * 3 * 3 * 2 * 5 * 16 * 4, "total": 2 * 3 * 3 * 2 * 5 * 16 * 4}
    assert step["observed"][PRODUCT_RULE] == {owner: step["truth"]["raw"]}
    view = views(result["manifest"])[owner]
    assert (view.observed_bytes, view.unexplained_bytes, view.declares) == (step["truth"]["raw"],) * 2 + (False,)


@pytest.mark.parametrize("case", sorted(RULE4_STORES))
def test_a_per_layer_store_of_a_module_that_declares_nothing_is_its_own_unexplained_to_the_byte(
    corpus: dict[str, dict[str, Any]], release: Release, case: str
) -> None:
    """Rule 4: each store is observed under the module holding it (the attention, the transformer or the decoder
    keeping it), all unexplained, to the byte, from the moment it is allocated; nothing before."""
    if release.version not in RULE4_STORES[case]:
        pytest.skip(f"{case}'s store is not in vllm-omni {release.version}")
    owners, stored = RULE4_STORES[case][release.version]
    result = corpus[case]
    assert result["declared"] == {} and result["rule4_modules"]  # rule 4 looked at the case's modules
    moments = result["moments"]
    last = moments.get("step", moments["idle"])
    if "step" in moments:
        assert moments["idle"]["truth"]["total"] == 0 and moments["idle"]["observed"][PRODUCT_RULE] == {}
    assert last["truth"] == {"caches": 0, "raw": stored, "total": stored}
    observed = last["observed"][PRODUCT_RULE]
    assert set(observed) == set(owners) and sum(observed.values()) == stored
    for owner, view in views(result["manifest"]).items():
        if owner in owners:
            assert (view.observed_bytes, view.unexplained_bytes, view.declares) == (observed[owner],) * 2 + (False,)


def test_the_corpus_fails_rule_4_on_shape_alone_or_names_alone(
    corpus: dict[str, dict[str, Any]], release: Release
) -> None:
    """The negative corpus of rule 4: by shape alone it takes convolution histories beside the K/V for K/V (fish's
    DAC stream state, Qwen3-TTS's streaming decoder; on 0.30.0 the fast-AR predictor's hidden buffers); by names
    alone the int64 offsets beside the rings (personaplex's `_RingKV`, moss_tts v2's `RingKVCache`)."""
    assert violations(corpus, STORE_RULE) == []
    shape = {v.split(":")[0] for v in violations(corpus, "shape_only")}
    names = {v.split(":")[0] for v in violations(corpus, "names_only")}
    assert {"personaplex step", "moss_v2 step"} <= names
    if release.version == OMNI_032.version:
        assert {"fish_dac_stream idle", "fish_dac_stream step", "qwen3_tts_stream_decoder idle"} <= shape
    else:
        assert "fish_speech_fast_ar step" in shape
