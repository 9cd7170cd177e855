"""vllm-omni 0.30's real model-local KV holders, driven through several steps inside one observation interval and
published through the hook's own path, with an independent count of what their caches held at the most.

Run in .venv-omni only:
    .venv-omni/bin/python -m kvx_omni_testplugin.upstream_peaks OUT_DIR CASE [CASE ...]
The process installs kv-exporter's observation the way the plugin does (before transformers is imported), imports
what every case needs once, then forks one child per case, one after the other. A child builds its case from a
small random config (the real upstream classes; `bare` where the real `__init__` builds a vLLM engine or loads by hub
name), publishes the load manifest with the hook's `publish` (the interval starts there), runs the case's steps,
publishes the warmup manifest (its observation closes the interval) into OUT_DIR/manifests, writes
OUT_DIR/CASE.json and stays alive: the sidecar only serves the manifests of live processes. Once every child has
written its result the parent prints `READY`; when its stdin closes, the children exit (removing their manifests,
as the hook does) and so does it.

The independent count (`StorageCount`): a profile function (`sys.setprofile`) that, at every Python and C call and
return of the steps, sums the distinct storages (`untyped_storage()`, by data pointer) behind the K and V tensors of
every live transformers cache, and keeps the most. It finds the caches itself (a `Cache` any function returns, the
`self` of a cache class's `__init__`), holds them weakly, and shares nothing with kv-exporter's registry, accounts or
sampler. Its figure is the maximum over a finer set of instants than any cache method's return.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any

from kv_exporter.manifest import Phase
from kv_exporter.plugin import observe
from kv_exporter.plugin.hooks import install_post_import
from kv_exporter.plugin.publish import publish
from kv_exporter.plugin.settings import HookSettings
from kvx_omni_testplugin.real_classes import bare
from kvx_omni_testplugin.vllm_roots import mimo_root

MAX_NUM_SEQS = 4
# Longer than any run: no sampler sample lands inside the steps. The interval is the one between the load and the
# warmup publish, each of which takes a sample the way the hook's own publish does.
INTERVAL_S = 3600.0
READY = "READY"


def all_subclasses(cls: type) -> Iterator[type]:
    yield cls
    for sub in cls.__subclasses__():
        yield from all_subclasses(sub)


_PLUMBING = (f"{os.sep}copy.py", f"{os.sep}copyreg.py")
_KV = f"{os.sep}kv_exporter{os.sep}"


class StorageCount:
    """The most storage the live transformers caches held at any call or return event while it ran (see the module
    docstring); each storage once, by data pointer."""

    def __init__(self) -> None:
        from transformers.cache_utils import Cache

        self._cache_base = Cache
        self._inits = {
            init.__code__
            for cls in all_subclasses(Cache)
            if callable(init := vars(cls).get("__init__")) and hasattr(init, "__code__")
        }
        self._caches: weakref.WeakSet[Any] = weakref.WeakSet()
        self.peak = 0
        self.events = 0
        self.creators: Counter[str] = Counter()  # qualified name of the upstream function that made each cache

    def held(self) -> int:
        import torch

        storages: dict[int, int] = {}
        for cache in list(self._caches):
            layers = cache.__dict__.get("layers")
            for layer in layers if isinstance(layers, list) else ():
                for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(tensor, torch.Tensor):
                        storage = tensor.untyped_storage()
                        if storage.nbytes():
                            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def _found(self, cache: Any, frame: FrameType | None) -> None:
        if cache in self._caches:
            return
        self._caches.add(cache)
        # The maker: the first frame out of the cache classes' own __init__, copy's machinery and kv-exporter's hooks.
        while frame is not None and (
            frame.f_code in self._inits
            or frame.f_code.co_filename.endswith(_PLUMBING)
            or _KV in frame.f_code.co_filename
        ):
            frame = frame.f_back
        self.creators[frame.f_code.co_qualname if frame is not None else "?"] += 1

    def _event(self, frame: FrameType, event: str, arg: Any) -> None:
        self.events += 1
        if event == "return":
            if isinstance(arg, self._cache_base):
                self._found(arg, frame)
            elif frame.f_code in self._inits:
                obj = frame.f_locals.get(frame.f_code.co_varnames[0])
                if isinstance(obj, self._cache_base):
                    self._found(obj, frame)
        if self._caches:
            held = self.held()
            if held > self.peak:
                self.peak = held

    def run(self, step: Callable[[], Any]) -> None:
        sys.setprofile(self._event)
        try:
            step()
        finally:
            sys.setprofile(None)
        held = self.held()  # what is left between steps counts too
        if held > self.peak:
            self.peak = held

    def watch(self, caches: Iterable[Any]) -> None:
        """Caches made before the count started (they may still hold storage inside the interval). No reference to
        them outlives the call: a caller's loop variable would keep the last one alive after upstream drops it."""
        for cache in caches:
            self._caches.add(cache)
        self.peak = max(self.peak, self.held())


@dataclass
class Case:
    """One upstream model, built: the root the runner holds, the steps of one interval, what the test checks."""

    root: Any
    steps: list[Callable[[], Any]]
    expected_owner: str  # the module the caches are charged to
    facts: dict[str, Any] = field(default_factory=dict)  # the case's own figures, for the report and the test
    before: list[Callable[[], Any]] = field(default_factory=list)  # steps run before the interval (during load)
    existing_caches: Callable[[], list[Any]] = list  # caches alive when the interval starts (e.g. a request's)
    after: Callable[[], dict[str, Any]] = dict  # figures read once the steps have run


# -- Qwen3-TTS code2wav ----------------------------------------------------------------------------------------------

QWEN_WINDOW = 8  # the decoder's sliding window (72 in the released checkpoint)
QWEN_INITIAL = 2  # initial_codec_chunk_frames
QWEN_CHUNK = 3  # codec_chunk_frames (25 released): new frames per later chunk


def qwen3_tts_decoder_config() -> dict[str, Any]:
    return {
        "codebook_size": 32,
        "codebook_dim": 16,
        "hidden_size": 32,
        "latent_dim": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "sliding_window": QWEN_WINDOW,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_quantizers": 2,
        "upsample_rates": [2],
        "upsampling_ratios": [2],
        "decoder_dim": 16,
        "max_position_embeddings": 256,
    }


def qwen3_tts_code2wav(folder: Path) -> Any:
    """The real Qwen3TTSCode2Wav: its real __init__ reads speech_tokenizer/config.json from a folder written here, its
    real load_weights loads the decoder's (random) weights from speech_tokenizer/ with vLLM's loader."""
    import torch
    from safetensors.torch import save_file
    from vllm.config import LoadConfig
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Decoder,
    )

    tokenizer_dir = folder / "speech_tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    config = Qwen3TTSTokenizerV2Config(decoder_config=qwen3_tts_decoder_config(), output_sample_rate=24000)
    config.save_pretrained(tokenizer_dir)
    weights = Qwen3TTSTokenizerV2Decoder._from_config(config.decoder_config).state_dict()
    save_file({f"decoder.{k}": v.contiguous() for k, v in weights.items()}, str(tokenizer_dir / "model.safetensors"))
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(
            model=str(folder),
            async_chunk=True,
            revision=None,
            dtype=torch.float32,
            enforce_eager=True,
            stage_connector_config={
                "extra": {"codec_chunk_frames": QWEN_CHUNK, "initial_codec_chunk_frames": QWEN_INITIAL}
            },
        ),
        load_config=LoadConfig(),
        device_config=SimpleNamespace(device=torch.device("cpu")),
    )
    model = Qwen3TTSCode2Wav(vllm_config=vllm_config)
    model.load_weights(iter(()))
    return model


class Qwen3Requests:
    """Drives Qwen3TTSCode2Wav.forward as the generation runner does: one call per step, codec frames of several
    requests concatenated in input_ids, each request's id and metadata beside them."""

    def __init__(self, model: Any, prefix_frames: int) -> None:
        import torch

        self.model = model
        self.prefix_frames = prefix_frames  # 0: an x-vector prompt; > 0: an ICL reference prefix of that many frames
        self.q = int(model._num_quantizers)
        self.codebook = int(model.decoder.config.codebook_size)
        self.generator = torch.Generator().manual_seed(0)
        self.started: set[str] = set()

    def step(self, chunks: dict[str, tuple[int, bool]]) -> None:
        """One forward: request id -> (new frames, finished)."""
        import torch

        ids, counts, infos = [], [], []
        for request_id, (frames, finished) in chunks.items():
            first = request_id not in self.started
            self.started.add(request_id)
            total = frames + (self.prefix_frames if first else 0)
            codes = torch.randint(0, self.codebook, (self.q * total,), generator=self.generator)
            ids.append(codes)
            counts.append(codes.numel())
            meta: dict[str, Any] = {"request_id": request_id, "finished": finished}
            if self.prefix_frames:
                meta.update(ref_context_size=self.prefix_frames, ref_context_included=first)
            infos.append({"meta": meta})
        with torch.no_grad():
            self.model(
                input_ids=torch.cat(ids),
                runtime_additional_information=infos,
                request_ids=list(chunks),
                seq_token_counts=counts,
            )


def qwen_per_position(model: Any) -> int:
    """Bytes of one position of one row over all layers, K and V: the geometry, read from the decoder's config."""
    config = model.decoder.config
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    itemsize = next(model.decoder.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize


# Request id -> (new frames, finished) per step. x-vector prompt: the first chunk is QWEN_INITIAL frames, then
# QWEN_CHUNK per step (2 -> 5 -> 8 retained frames, then rolling at the window). The largest step is in the middle.
QWEN_XVEC_STEPS: list[dict[str, tuple[int, bool]]] = [
    {"r0": (QWEN_INITIAL, False)},
    {"r0": (QWEN_CHUNK, False), "r1": (QWEN_INITIAL, False), "r2": (QWEN_INITIAL, False), "r3": (QWEN_INITIAL, False)},
    {"r0": (QWEN_CHUNK, False), "r1": (QWEN_CHUNK, False), "r2": (QWEN_CHUNK, False), "r3": (QWEN_CHUNK, False)},
    {"r0": (QWEN_CHUNK, False), "r1": (QWEN_CHUNK, False), "r2": (QWEN_CHUNK, False), "r3": (QWEN_CHUNK, False)},
    {"r0": (QWEN_CHUNK, True), "r1": (QWEN_CHUNK, True), "r2": (QWEN_CHUNK, True), "r3": (QWEN_CHUNK, True)},
    {"r4": (QWEN_INITIAL, False)},
    {"r4": (QWEN_CHUNK, True)},
]


def case_qwen3_tts_eager(folder: Path) -> Case:
    """Async-chunk decoding on the decoder's eager path (no CUDA-graph wrapper: what enforce_eager, a CPU device or
    a stage without graphs gives): it declares nothing."""
    model = qwen3_tts_code2wav(folder)
    requests = Qwen3Requests(model, prefix_frames=0)
    return Case(
        root=model,
        steps=[lambda chunks=chunks: requests.step(chunks) for chunks in QWEN_XVEC_STEPS],
        expected_owner="decoder",
        facts={"per_position": qwen_per_position(model), "window": QWEN_WINDOW, "wrapper": False},
        after=lambda: {"retained_states": len(model._decoder_state_cache)},
    )


# ICL prompts on the eager path, two requests batched: their first chunk runs before the interval (the prefix
# cache its pre_transformer makes is gone by then; each request retains its slice); inside the interval, two batched
# suffix steps, each concatenating the retained caches into a batched one (`_batch_dynamic_caches` assigns the
# batched layers' keys and values itself) and deep-copying that into the working cache.
QWEN_ICL_BATCHED_FIRST: dict[str, tuple[int, bool]] = {"r0": (QWEN_INITIAL, False), "r1": (QWEN_INITIAL, False)}
QWEN_ICL_BATCHED_STEPS: list[dict[str, tuple[int, bool]]] = [
    {"r0": (QWEN_CHUNK, False), "r1": (QWEN_CHUNK, False)},
    {"r0": (QWEN_CHUNK, True), "r1": (QWEN_CHUNK, True)},
]


def retained_caches(model: Any) -> list[Any]:
    return [state["past_key_values"] for state in model._decoder_state_cache.values() if "past_key_values" in state]


def case_qwen3_tts_eager_icl(folder: Path) -> Case:
    """The eager path of case_qwen3_tts_eager with ICL prompts (a reference prefix of a whole window)."""
    model = qwen3_tts_code2wav(folder)
    requests = Qwen3Requests(model, prefix_frames=QWEN_WINDOW)
    return Case(
        root=model,
        before=[lambda: requests.step(QWEN_ICL_BATCHED_FIRST)],
        steps=[lambda chunks=chunks: requests.step(chunks) for chunks in QWEN_ICL_BATCHED_STEPS],
        expected_owner="decoder",
        existing_caches=lambda: retained_caches(model),
        facts={"per_position": qwen_per_position(model), "window": QWEN_WINDOW, "wrapper": False},
        after=lambda: {"retained_states": len(model._decoder_state_cache)},
    )


QWEN_ICL_PREFIX = QWEN_WINDOW - 1  # reference frames of an ICL prompt
# ICL requests, at most two at once (of MAX_NUM_SEQS): 7 retained prefix frames each, then 2 -> 5 -> 8 -> rolling.
QWEN_ICL_STEPS: list[dict[str, tuple[int, bool]]] = [
    {"r0": (QWEN_INITIAL, False)},
    {"r0": (QWEN_CHUNK, False), "r1": (QWEN_INITIAL, False)},
    {"r0": (QWEN_CHUNK, False), "r1": (QWEN_CHUNK, False)},
    {"r0": (QWEN_CHUNK, False), "r1": (QWEN_CHUNK, False)},
    {"r0": (QWEN_CHUNK, True), "r1": (QWEN_CHUNK, True)},
    {"r2": (QWEN_INITIAL, False)},
]


def case_qwen3_tts_wrapper(folder: Path) -> Case:
    """The decoder with its CUDA-graph wrapper attached by its real enable_cudagraph, every capture of which failed
    (what warmup leaves when capture cannot run: it logs each failure and goes on): the wrapper is there, so the
    decoder declares its per-request cache and working copy; with no graph captured, each request is decoded on
    the eager fallback, where the first ICL chunk's cache is made by its child `pre_transformer`."""
    import torch

    # On a CUDA build this answers False outside a capture; torch's CPU build raises instead ("Tried to instantiate
    # dummy base class _cuda_isCurrentStreamCapturing"), which the wrapper's batch paths call unguarded.
    torch.cuda.is_current_stream_capturing = lambda: False
    model = qwen3_tts_code2wav(folder)
    decoder = model.decoder
    decoder.enable_cudagraph(
        device=torch.device("cuda"),  # no capture can run on this CPU-only build: each one fails, as on a GPU
        codec_chunk_frames=QWEN_CHUNK,
        initial_codec_chunk_frames=QWEN_INITIAL,
        async_chunk=True,
    )
    wrapper = decoder._cudagraph_wrapper
    assert wrapper is not None and decoder._cudagraph_enabled and not wrapper._warmed_up
    requests = Qwen3Requests(model, prefix_frames=QWEN_ICL_PREFIX)
    return Case(
        root=model,
        steps=[lambda chunks=chunks: requests.step(chunks) for chunks in QWEN_ICL_STEPS],
        expected_owner="decoder",
        facts={
            "per_position": qwen_per_position(model),
            "window": QWEN_WINDOW,
            "wrapper": True,
            "captured": len(wrapper.combined_states) + len(wrapper.icl_prefix_states) + len(wrapper.xvec_prefix_states),
        },
        after=lambda: {"retained_states": len(model._decoder_state_cache)},
    )


# -- MiniCPM-o 4.5: the streaming Whisper of one duplex session ----------------------------------------------------

MINICPMO_POSITIONS = 64  # Whisper's max_source_positions (1500 released): the declared capacity
MINICPMO_MEL_FRAMES = 20  # per streaming chunk: 10 positions after the stride-2 conv, 9 once the suffix frame goes
MINICPMO_CHUNKS = 4


def case_minicpmo(folder: Path) -> Case:
    """One duplex session's streaming audio, through the real duplex runtime (`_stage_audio_embeddings`, which swaps
    the session's cache in and out of the thinker) on the real `get_audio_embedding_streaming` of the thinker and the
    real MiniCPMWhisperEncoder: its EncoderDecoderCache grows by one chunk per step and stays with the session."""
    import torch
    from torch import nn
    from transformers import PretrainedConfig, WhisperConfig
    from vllm_omni.model_executor.models.minicpmo_4_5.duplex.stage0 import (
        MiniCPMO45Stage0DuplexRuntime,
        _MiniCPMO45Stage0SessionState,
    )
    from vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni import MiniCPMO45OmniForConditionalGeneration
    from vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni_llm import (
        MiniCPMO45OmniLLMForConditionalGeneration,
        MiniCPMWhisperEncoder,
        MultiModalProjector,
    )

    audio = WhisperConfig(
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=256,  # the thinker's projector takes encoder_ffn_dim // 4 = d_model
        num_mel_bins=16,
        max_source_positions=MINICPMO_POSITIONS,
    )
    audio._attn_implementation = "eager"
    pool_step = 2
    thinker = bare(  # the attributes the thinker's real __init__ gives its audio path
        MiniCPMO45OmniLLMForConditionalGeneration,
        config=PretrainedConfig(audio_pool_step=pool_step),
        apm=MiniCPMWhisperEncoder(audio).eval(),
        audio_avg_pooler=nn.AvgPool1d(pool_step, stride=pool_step),
        audio_projection_layer=MultiModalProjector(in_dim=audio.encoder_ffn_dim // 4, out_dim=32),
        audio_encoder_layer=-1,
        audio_past_key_values=None,
    )
    root = bare(MiniCPMO45OmniForConditionalGeneration, thinker=thinker)
    runtime = MiniCPMO45Stage0DuplexRuntime(root, model_path=None, device="cpu")  # its real __init__
    root._minicpmo45_duplex_data_plane_helper = runtime  # where _duplex_data_plane_helper keeps it
    state = _MiniCPMO45Stage0SessionState(session_id="s0")
    runtime.sessions["s0"] = state  # as the root's duplex preprocess stores a new session

    def chunk() -> None:
        features = {
            "audio_features": torch.randn(1, audio.num_mel_bins, MINICPMO_MEL_FRAMES),
            "audio_feature_lens": [torch.tensor([MINICPMO_MEL_FRAMES])],
        }
        with torch.no_grad():
            runtime._stage_audio_embeddings(features, state=state)

    head_dim = audio.d_model // audio.encoder_attention_heads
    return Case(
        root=root,
        steps=[chunk] * MINICPMO_CHUNKS,
        expected_owner="thinker.apm",
        facts={
            "per_position": 2 * audio.encoder_layers * audio.encoder_attention_heads * head_dim * 4,
            "capacity_positions": MINICPMO_POSITIONS,
        },
        after=lambda: {
            "session_cache": type(state.audio_past_key_values).__name__,
            "session_positions": int(state.audio_past_key_values.get_seq_length()),
            "thinker_cache_restored": thinker.audio_past_key_values is None,
        },
    )


# -- Ming-flash-omni's talker: a StaticCache per text segment -------------------------------------------------------


class ByteTokenizer:
    """The talker loads its tokenizer by path or hub name (its `tokenizer` property); `build_tts_input` only calls
    `encode`, and wants the special tokens it looks up as single ids. Bytes, then those tokens, within the vocab."""

    SPECIAL = ("<|vision_start|>", "<|vision_pad|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>", "<audio>")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        while text:
            special = next((s for s in self.SPECIAL if text.startswith(s)), None)
            if special is not None:
                ids.append(256 + self.SPECIAL.index(special))
                text = text[len(special) :]
            else:
                ids.extend(text[0].encode())
                text = text[1:]
        return ids


MING_TEXT = "The talker reads this first sentence aloud. Then it reads a second one. And a third."
MING_MAX_TEXT_LENGTH = 12  # segment_and_normalize's max_length: one segment per sentence
MING_DECODE_STEPS = 3


def case_ming_talker(folder: Path) -> Case:
    """The real talker forward: one request of several text segments per step, each segment a whole AR loop in
    MingAudioGenerator.generate_latents, which builds a StaticCache for it and drops it when it returns."""
    import torch
    from torch import nn
    from transformers import Qwen2Config, Qwen2Model
    from vllm_omni.model_executor.models.common.ming.aggregator import Aggregator
    from vllm_omni.model_executor.models.ming_flash_omni.ming_flash_omni_talker import (
        MingFlashOmniTalkerForConditionalGeneration,
    )
    from vllm_omni.model_executor.models.ming_flash_omni.talker_module import CFM, DiT, MingAudioGenerator
    from vllm_omni.model_executor.models.ming_flash_omni.text_processing import segment_and_normalize
    from vllm_omni.model_executor.models.ming_tts.constants import SPEAKER_EMBEDDING_DIM
    from vllm_omni.transformers_utils.configs.ming_flash_omni import MingFlashOmniTalkerConfig

    hidden = 64
    llm = Qwen2Config(
        vocab_size=272,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    llm._attn_implementation = "sdpa"  # as the talker's __init__ sets it
    blocks = {"hidden_size": 32, "depth": 1, "num_heads": 2, "mlp_ratio": 2.0}
    config = MingFlashOmniTalkerConfig(
        flowmodel={**blocks, "in_channels": 8, "llm_cond_dim": hidden},
        aggregator=dict(blocks),
        steps=2,
        patch_size=2,
        history_patch_size=2,
        latent_dim=8,
    )
    # The attributes the talker's real __init__ sets (it resolves configs, the VAE and the voice presets by path).
    talker = bare(
        MingFlashOmniTalkerForConditionalGeneration,
        have_multimodal_outputs=True,
        has_preprocess=False,
        has_postprocess=False,
        config=config,
        llm_config=llm,
        hidden_size=hidden,
        latent_dim=config.latent_dim,
        patch_size=config.patch_size,
        his_patch_size=config.history_patch_size,
        cfg_strength=config.cfg_strength,
        model=Qwen2Model(llm),
        cfm=CFM(DiT(llm_input_dim=hidden, **config.flowmodel), steps=config.steps),
        aggregator=Aggregator(llm_input_dim=hidden, **{"in_channels": config.latent_dim, **config.aggregator}),
        stop_head=nn.Linear(hidden, 2, bias=True),
        spk_head=nn.Linear(SPEAKER_EMBEDDING_DIM, hidden, bias=True),
        audio_vae=None,
        _use_cuda_graphs=False,
    )
    talker.to(torch.bfloat16).eval()  # build_tts_input makes bf16 embeddings, as the checkpoint's dtype
    talker.audio_generator = MingAudioGenerator(
        config=config,
        llm_config=llm,
        model=talker.model,
        cfm=talker.cfm,
        aggregator=talker.aggregator,
        stop_head=talker.stop_head,
        audio_vae=None,
        patch_size=talker.patch_size,
        his_patch_size=talker.his_patch_size,
        latent_dim=talker.latent_dim,
        cfg_strength=talker.cfg_strength,
        use_cuda_graphs=False,
    )
    talker.tokenizer = ByteTokenizer()  # stored over the cached property, as its first read would
    segments = segment_and_normalize(MING_TEXT, max_length=MING_MAX_TEXT_LENGTH)
    info = {
        "text": MING_TEXT,
        "max_text_length": MING_MAX_TEXT_LENGTH,
        "max_steps": MING_DECODE_STEPS,
        "use_zero_spk_emb": True,
    }

    def request() -> None:
        with torch.no_grad():
            talker(input_ids=torch.zeros(1, dtype=torch.long), positions=None, runtime_additional_information=[info])

    head_dim = llm.hidden_size // llm.num_attention_heads
    generator = talker.audio_generator
    return Case(
        root=talker,
        steps=[request, request],
        expected_owner="",
        facts={
            "segments": len(segments),
            "static_cache_bytes": 2
            * llm.num_hidden_layers
            * llm.num_key_value_heads
            * head_dim
            * generator._STATIC_CACHE_LEN
            * 2,  # bf16; one row
        },
    )


# -- MiMo-Audio: a cache its input local transformer makes and drops on every call ----------------------------------

MIMO_STEPS = [(1, 3), (2, 5), (1, 2)]  # (batch, groups) per call, the largest in the middle


def case_mimo(folder: Path) -> Case:
    """The real apply_input_local_transformer of MiMoAudioLLMForConditionalGeneration, built by its real __init__
    (its staging buffers registered): its input_local_transformer (transformers' Qwen2Model, use_cache on by
    default) declares nothing and builds a DynamicCache on every call."""
    import torch

    root = mimo_root(folder)
    config = root.config

    def call(batch: int, groups: int) -> None:
        hidden = root.input_local_config.hidden_size
        with torch.no_grad():
            root.apply_input_local_transformer(
                torch.randn(batch, groups, config.group_size, hidden, dtype=torch.bfloat16)
            )

    local = root.input_local_config
    return Case(
        root=root,
        steps=[lambda b=b, g=g: call(b, g) for b, g in MIMO_STEPS],
        expected_owner="input_local_transformer",
        facts={
            # K and V of every layer of the input local config, group_size positions, one row per group, bf16
            "per_row_group": 2
            * local.num_hidden_layers
            * local.num_key_value_heads
            * local.head_dim
            * config.group_size
            * 2,
            "rows_groups": [b * g for b, g in MIMO_STEPS],
            # the root's bf16 staging buffer for audio embeddings, registered by __init__: not KV
            "staging_buffer": root._new_audio_emb_buffer.untyped_storage().nbytes(),
        },
    )


CASES: dict[str, Callable[[Path], Case]] = {
    "qwen3_tts_eager": case_qwen3_tts_eager,
    "qwen3_tts_eager_icl": case_qwen3_tts_eager_icl,
    "qwen3_tts_wrapper": case_qwen3_tts_wrapper,
    "minicpmo": case_minicpmo,
    "ming_talker": case_ming_talker,
    "mimo": case_mimo,
}


def runner_for(name: str, root: Any) -> Any:
    """What the hook reads off vLLM's model runner."""
    import torch

    return SimpleNamespace(
        model=root,
        device=torch.device("cpu"),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
        model_config=SimpleNamespace(served_model_name=[name], model=name),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )


def run_case(name: str, out: Path, settings: HookSettings) -> dict[str, Any]:
    import torch

    started = time.monotonic()
    torch.manual_seed(0)
    case = CASES[name](Path(tempfile.mkdtemp(prefix=f"kvx-{name}-")))
    runner = runner_for(name, case.root)
    for step in case.before:
        step()
    load = publish(runner, Phase.LOAD, settings)  # attaches observation; its sample opens the interval
    count = StorageCount()
    count.watch(case.existing_caches())
    for step in case.steps:
        count.run(step)
    at_end = count.held()
    warmup = publish(runner, Phase.WARMUP, settings)  # its sample closes the interval
    assert load is not None and warmup == load, (load, warmup)
    return {
        "case": name,
        "manifest": str(warmup),
        "pid": os.getpid(),
        "steps": len(case.steps),
        "independent_peak": count.peak,
        "independent_at_sample": at_end,
        "profile_events": count.events,
        "creators": dict(count.creators),
        "seconds": round(time.monotonic() - started, 2),
        "expected_owner": case.expected_owner,
        **case.facts,
        **case.after(),
    }


def child(name: str, out: Path, settings: HookSettings, release: int) -> None:
    """Run one case, write its result, and stay alive until `release` (a pipe) closes."""
    import torch

    torch.set_num_threads(1)
    os.dup2(2, 1)  # the parent's stdout carries READY alone; vLLM's logger writes to stdout
    status = 1
    try:
        result = run_case(name, out, settings)
        status = 0
    except BaseException as exc:  # reported through the result file, read by the test
        result = {"case": name, "error": repr(exc)}
        import traceback

        traceback.print_exc()
    partial = out / f".{name}.json.part"
    partial.write_text(json.dumps(result))
    partial.replace(out / f"{name}.json")  # whole or absent: the parent waits for it, the test reads it
    while os.read(release, 1):
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(status)


def prepare() -> None:
    """Import once, in the parent, what the cases import (the children share it)."""
    import transformers.cache_utils  # noqa: F401  # patched now, as the plugin patches it
    import vllm_omni.model_executor.models.mimo_audio.mimo_audio_llm
    import vllm_omni.model_executor.models.ming_flash_omni.ming_flash_omni_talker
    import vllm_omni.model_executor.models.minicpmo_4_5.duplex.stage0
    import vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni
    import vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav  # noqa: F401


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args()
    manifests = args.out / "manifests"
    settings = HookSettings(
        disabled=False,
        directory=manifests,
        explicit_directory=True,
        collector="auto",
        observe_interval_s=INTERVAL_S,
        observe_peak=True,
    )
    assert "transformers" not in sys.modules  # the cache classes are patched as transformers defines them
    install_post_import(observe.patches(settings))
    prepare()
    release_read, release_write = os.pipe()
    children: dict[str, int] = {}
    for name in args.cases:
        pid = os.fork()
        if pid == 0:
            os.close(release_write)
            child(name, args.out, settings, release_read)
        children[name] = pid
        while not (args.out / f"{name}.json").exists():  # one case at a time: the cores are shared
            finished, _ = os.waitpid(pid, os.WNOHANG)
            if finished:
                break
            time.sleep(0.05)
    os.close(release_read)
    print(READY, flush=True)
    sys.stdin.read()  # until the test closes it
    os.close(release_write)
    failed = []
    for name, pid in children.items():
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(name)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
