"""The corpus of vllm-omni's declaring modules, built as upstream builds them, for the rule that counts a declaring
owner's state as K/V (kv_exporter/plugin/observe/holders.py) and every other rule beside the transformers caches.

Run in either omni venv:
    .venv-omni/bin/python -m kvx_omni_testplugin.corpus OUT_DIR CASE [CASE ...]
It installs kv-exporter's observation the way the plugin does (before transformers is imported), imports what the
cases need once, then forks one child per case, one after the other. A child builds its model, publishes the load
manifest with the hook's `publish` (which attaches the observation), and at each moment of the case ("idle" right
after load, then "step" after the case's steps, where it has any) takes one observation under each state rule of
`RULES`: the product's own and the looser rules it replaced, swapped in for `holders.kv_evidence`; and under each
rule-4 variant of `STORE_RULES` (the product's, shape alone, names alone) swapped in for `holders.named_kv`. It writes
OUT_DIR/CASE.json with, per moment:
- `truth`: the K/V alive, counted here without kv-exporter: every live transformers `Cache` the garbage collector
  knows (each K and V storage once, by data pointer), and the raw K/V tensors the case names from upstream's own
  attributes (VibeVoice's negative pool, MiniCPM-o 0.32's session buffers);
- `observed`: owner -> bytes under each rule;
- `state`: every tensor in every declaring owner's own state (an independent walk: attributes, registered buffers,
  containers and plain objects, never another module or a parameter), with its path, shape, dtype, bytes and
  whether it is K/V by the truth above. This is what the state rule chooses from.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from kv_exporter.manifest import Phase
from kv_exporter.plugin import observe
from kv_exporter.plugin.hooks import install_post_import
from kv_exporter.plugin.observe import holders, raw_stores
from kv_exporter.plugin.observe.owners import Geometry
from kv_exporter.plugin.publish import publish
from kv_exporter.plugin.settings import HookSettings
from kvx_omni_testplugin import real_classes, store_cases, upstream_peaks
from kvx_omni_testplugin.store_cases import Built
from kvx_omni_testplugin.vllm_roots import mimo_root

MAX_NUM_SEQS = 4


# -- the state rules: the product's, and the two it replaced ---------------------------------------------------------


def whole_kv_vectors(tensor: Any, declared: Collection[Geometry]) -> bool:
    """The rule before issue 39 (main before fdc163c): a declared dtype and a whole number of KV vectors."""
    numel, dtype = int(tensor.numel()), str(tensor.dtype).removeprefix("torch.")
    return numel > 0 and any(dtype == g.dtype and numel % (g.kv_heads * g.head_dim) == 0 for g in declared)


def declared_dtype(tensor: Any, declared: Collection[Geometry]) -> bool:
    """Looser still: any non-empty tensor of a declared dtype."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return int(tensor.numel()) > 0 and any(dtype == g.dtype for g in declared)


RULES: dict[str, Callable[[Any, Collection[Geometry]], bool]] = {
    "kv_evidence": holders.kv_evidence,
    "whole_kv_vectors": whole_kv_vectors,
    "declared_dtype": declared_dtype,
}


# -- rule 4 (raw stores of modules that declare nothing): the product's, and the two halves of it alone ---------------


def shape_only(tensor: Any, named: bool, heads: raw_stores.Heads) -> bool:
    """Rule 4 without its names: any tensor whose shape shows the heads the modules name."""
    return raw_stores.heads_evidence(tensor, heads)


def names_only(tensor: Any, named: bool, heads: raw_stores.Heads) -> bool:
    """Rule 4 without its shape: any non-empty tensor a K/V name leads to, in a module whose neighbours name heads."""
    return named and int(tensor.numel()) > 0


STORE_RULES: dict[str, Callable[[Any, bool, raw_stores.Heads], bool]] = {
    "named_kv": raw_stores.named_kv,
    "shape_only": shape_only,
    "names_only": names_only,
}


# -- the independent count -------------------------------------------------------------------------------------------


def storages(tensors: Iterator[Any]) -> dict[int, int]:
    """data pointer -> bytes of the distinct non-empty storages behind `tensors`."""
    found: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def live_cache_tensors() -> Iterator[Any]:
    """K and V of every transformers Cache alive now, found by the garbage collector."""
    import torch
    from transformers.cache_utils import Cache

    gc.collect()
    for obj in gc.get_objects():
        if not isinstance(obj, Cache):
            continue
        parts = [getattr(obj, "self_attention_cache", None), getattr(obj, "cross_attention_cache", None), obj]
        for part in parts:
            for layer in getattr(part, "__dict__", {}).get("layers", None) or ():
                for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(tensor, torch.Tensor):
                        yield tensor


def state_tensors(module: Any) -> Iterator[tuple[str, Any]]:
    """(path, tensor) for every tensor in `module`'s own state, `holders.STATE_DEPTH` steps deep, as the rule walks
    it but written apart from it: attributes and registered buffers, then containers and plain objects."""
    import torch

    internals = frozenset(vars(torch.nn.Module()))
    start = [(name, value) for name, value in vars(module).items() if name not in internals]
    start += [(name, value) for name, value in module._buffers.items() if value is not None]
    pending = [(name, value, 1) for name, value in start]
    seen = {id(module)}
    while pending:
        path, value, depth = pending.pop()
        if id(value) in seen or value is None or isinstance(value, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if not isinstance(value, torch.nn.Parameter):
                yield path, value
            continue
        if isinstance(value, torch.nn.Module) or callable(value) or depth >= holders.STATE_DEPTH:
            continue
        if isinstance(value, (list, tuple, set, frozenset)):
            pending += [(f"{path}[{i}]", child, depth + 1) for i, child in enumerate(value)]
        elif isinstance(value, dict):
            pending += [(f"{path}[{key!r}]", child, depth + 1) for key, child in value.items()]
        else:
            children = dict(vars(value)) if hasattr(value, "__dict__") else {}
            for klass in type(value).__mro__:
                for name in getattr(klass, "__slots__", ()):
                    if name not in ("__dict__", "__weakref__"):
                        children[name] = getattr(value, name, None)
            pending += [(f"{path}.{name}", child, depth + 1) for name, child in children.items()]


# -- the cases -------------------------------------------------------------------------------------------------------


def mimo_steps(root: Any) -> list[Callable[[], Any]]:
    """Eager decode on CPU: the input local transformer over a batch of groups, then the local transformer's
    decode loop (each makes a DynamicCache and drops it)."""
    import torch
    from vllm_omni.model_executor.models.mimo_audio.mimo_audio_llm import MiMoSampler

    hidden = root.input_local_config.hidden_size

    def input_local() -> None:
        with torch.no_grad():
            root.apply_input_local_transformer(torch.randn(2, 3, root.group_size, hidden, dtype=torch.bfloat16))

    def local() -> None:
        with torch.no_grad():
            embeds = torch.randn(2, 1, root.local_config.hidden_size, dtype=torch.bfloat16)
            root.local_forward(embeds, tokens_device=torch.device("cpu"), local_sampler=MiMoSampler(do_sample=False))

    return [input_local, local]


def case_mimo(folder: Path) -> Built:
    root = mimo_root(folder)
    return Built(root, mimo_steps(root), how="real __init__ (vLLM Qwen2 on a real VllmConfig), CPU: no graph buckets")


def case_mimo_graph_buffers(folder: Path) -> Built:
    """MiMo-Audio's root with its CUDA-graph buffer dicts filled as its `__init__` fills them on a GPU: one real
    MiMoLocalDecodeBuffer and MiMoInputLocalTransformerBuffer per bucket, and per bucket a graph object holding its
    buffer and the output tensor a capture returns (computed here by the eager run capture makes first; no graph)."""
    import torch
    from vllm_omni.model_executor.models.mimo_audio import mimo_audio_llm as mimo

    root = mimo_root(folder)
    with torch.no_grad():
        for bs in mimo.MIMO_CUDAGRAPH_BATCH_SIZES:
            local = mimo.MiMoLocalDecodeBuffer(root, max_batch_size=bs)
            embeds, sampler = local.inputs(bs)
            out = root.base_local_forward(embeds, tokens_device=torch.device("cpu"), local_sampler=sampler)
            root.local_forward_buf_by_bs[bs] = local
            root.local_forward_cg_by_bs[bs] = mimo.MiMoLocalDecodeCudaGraph(None, local, out, bs)
            inner = mimo.MiMoInputLocalTransformerBuffer(root, max_batch_size=bs)
            hidden = root.input_local_transformer(inputs_embeds=inner.inputs(bs), return_dict=True, is_causal=False)
            root.input_local_transformer_buf_by_bs[bs] = inner
            graph = mimo.MiMoInputLocalTransformerCudaGraph(None, inner, hidden.last_hidden_state, bs)
            root.input_local_transformer_cg_by_bs[bs] = graph
    return Built(root, how="real __init__, then every bucket's buffers and capture outputs as a GPU's __init__ keeps")


def from_peaks(name: str) -> Callable[[Path], Built]:
    """A case of upstream_peaks (its real classes, its steps)."""

    def build(folder: Path) -> Built:
        case = upstream_peaks.CASES[name](folder)
        for step in case.before:
            step()
        return Built(case.root, case.steps, how=f"upstream_peaks.{name}")

    return build


def from_real_classes(name: str) -> Callable[[Path], Built]:
    """A model of real_classes (0.32.0rc1): its root, and the raw K/V its upstream objects hold."""

    def build(folder: Path) -> Built:
        root, _ = real_classes.MODELS[name]()
        if name == "vibevoice":
            return Built(root, raw_kv=lambda: list(root.negative_kv._kv_caches), how="real_classes.vibevoice")
        if name == "minicpmo":
            return Built(root, raw_kv=lambda: [s._buffer for s in root.sessions], how="real_classes.minicpmo")
        return Built(root, how=f"real_classes.{name}")

    return build


CASES: dict[str, Callable[[Path], Built]] = {
    "mimo": case_mimo,
    "mimo_graph_buffers": case_mimo_graph_buffers,
    "qwen3_tts_eager": from_peaks("qwen3_tts_eager"),
    "qwen3_tts_wrapper": from_peaks("qwen3_tts_wrapper"),
    "minicpmo_030": from_peaks("minicpmo"),
    "ming_talker": from_peaks("ming_talker"),
    "vibevoice_032": from_real_classes("vibevoice"),
    "minicpmo_032": from_real_classes("minicpmo"),
    "fish_speech_fast_ar": lambda folder: store_cases.fast_ar(folder, "fish_speech"),
    "audio8_fast_ar": lambda folder: store_cases.fast_ar(folder, "audio8_tts"),
    "qwen3_code_predictor": store_cases.qwen3_code_predictor,
    "qwen3_tts_frame_cache": store_cases.qwen3_tts_frame_cache,
    "personaplex": store_cases.personaplex,
    "moss_v1": lambda folder: store_cases.moss_codec(folder, 1),
    "moss_v2": lambda folder: store_cases.moss_codec(folder, 2),
    "fish_dac_kv_cache": store_cases.fish_dac_kv_cache,
    "fish_dac_stream": store_cases.fish_dac_stream,
    "qwen3_tts_stream_decoder": store_cases.qwen3_tts_stream_decoder,
}


# -- one case --------------------------------------------------------------------------------------------------------


def moment(built: Built) -> dict[str, Any]:
    """Observations under each rule, the truth and the declaring owners' state, now."""
    observed: dict[str, dict[str, int]] = {}
    try:
        for name, rule in RULES.items():
            holders.kv_evidence = rule  # the walk looks it up by name at each tensor
            observation = observe.observe(pause=lambda: None)
            observed[name] = {o.owner: o.bytes for o in observation.owners if o.bytes}
        holders.kv_evidence = RULES["kv_evidence"]
        for name, store_rule in STORE_RULES.items():
            holders.named_kv = store_rule  # likewise
            observation = observe.observe(pause=lambda: None)
            observed[name] = {o.owner: o.bytes for o in observation.owners if o.bytes}
    finally:
        holders.kv_evidence = RULES["kv_evidence"]
        holders.named_kv = STORE_RULES["named_kv"]
    # Two samples under the product's rules: the second's interval starts where the first let go of what a looser
    # rule held, so the peak the manifest publishes is the product's own.
    for _ in range(2):
        observe.observe(pause=lambda: None)
    caches = storages(live_cache_tensors())
    raw = storages(iter(built.raw_kv()))
    kv = {**caches, **raw}
    active = holders.Holders.active
    assert active is not None and active._model is not None
    state = []
    for path in sorted(active._model.declaring):
        module = built.root.get_submodule(path) if path else built.root
        for name, tensor in state_tensors(module):
            ptr = tensor.untyped_storage().data_ptr()
            state.append(
                {
                    "owner": path,
                    "path": name,
                    "shape": list(tensor.shape),
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    "bytes": tensor.untyped_storage().nbytes(),
                    "kv": ptr in kv,
                }
            )
    return {
        "observed": observed,
        "truth": {"caches": sum(caches.values()), "raw": sum(raw.values()), "total": sum(kv.values())},
        "raw_owner": built.raw_owner,
        "state": state,
    }


def run_case(name: str, out: Path, settings: HookSettings) -> dict[str, Any]:
    import torch

    started = time.monotonic()
    torch.manual_seed(0)
    built = CASES[name](Path(tempfile.mkdtemp(prefix=f"kvx-corpus-{name}-")))
    runner = upstream_peaks.runner_for(name, built.root)
    manifest = publish(runner, Phase.LOAD, settings)
    assert manifest is not None
    active = holders.Holders.active
    assert active is not None and active._model is not None
    result: dict[str, Any] = {
        "case": name,
        "how": built.how,
        "declared": {path: sorted(map(list, g)) for path, g in active._model.declared.items()},
        # the modules rule 3 looks at (their own config describes attention), and rule 4 (heads are named around them)
        "rule3_modules": sorted(path for path, (_, geometry, _) in active._stores.items() if geometry is not None),
        "rule4_modules": sorted(path for path, (*_, heads) in active._stores.items() if heads != raw_stores.NO_HEADS),
        "moments": {"idle": moment(built)},
    }
    if built.steps:
        for step in built.steps:
            step()
        result["moments"]["step"] = moment(built)
    # The manifest as the hook publishes it now (a copy: the hook removes its own when the process exits).
    published = publish(runner, Phase.WARMUP, settings)
    assert published == manifest
    copy = out / "published" / f"{name}.json"
    copy.parent.mkdir(exist_ok=True)
    copy.write_bytes(published.read_bytes())
    result["manifest"] = str(copy)
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


def child(name: str, out: Path, settings: HookSettings) -> None:
    import torch

    torch.set_num_threads(1)
    os.dup2(2, 1)  # vLLM's logger writes to stdout
    status = 1
    try:
        result = run_case(name, out, settings)
        status = 0
    except BaseException as exc:  # reported through the result file, read by the test
        import traceback

        traceback.print_exc()
        result = {"case": name, "error": repr(exc)}
    partial = out / f".{name}.json.part"
    partial.write_text(json.dumps(result))
    partial.replace(out / f"{name}.json")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no interpreter teardown: the distributed group and the manifest die with the process


PRELOADED = (
    "vllm_omni.model_executor.models.mimo_audio.mimo_audio_llm",
    "vllm_omni.model_executor.models.ming_flash_omni.ming_flash_omni_talker",
    "vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni",
    "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav",
)


def prepare() -> None:
    """Import once, in the parent, what the cases import (the children share it); a module this venv cannot import
    fails its case, in the child, with the import's own error."""
    import importlib

    import transformers.cache_utils  # noqa: F401  # patched now, as the plugin patches it

    for name in PRELOADED:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args()
    settings = HookSettings(
        disabled=False,
        directory=args.out / "manifests",
        explicit_directory=True,
        collector="auto",
        observe_interval_s=3600.0,  # no sampler sample: this process observes at its moments only
    )
    assert "transformers" not in sys.modules  # the cache classes are patched as transformers defines them
    install_post_import(observe.patches(settings))
    prepare()
    failed = []
    for name in args.cases:  # one at a time: the cores are shared
        pid = os.fork()
        if pid == 0:
            child(name, args.out, settings)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(name)
    print(json.dumps({"failed": failed}), flush=True)


if __name__ == "__main__":
    main()
