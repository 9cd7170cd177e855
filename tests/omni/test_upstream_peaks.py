"""vllm-omni 0.30's real model-local KV holders on CPU, in .venv-omni: the high-water mark between two samples,
through the hook's real publish path, the manifests it writes and a real `kv-exporter serve` scraped over HTTP.

One harness (kvx_omni_testplugin.upstream_peaks) builds each case from a small random config with the upstream
classes, runs several steps inside one observation interval (between the load and the warmup publish), and counts
independently what the live caches held at the most (a profile function summing their distinct storages at every
call and return). Per case, the exported `model_local_kv_observed_peak_bytes` of the owner must equal that count to
the byte, `model_local_kv_unexplained_bytes` must be max(0, peak - the owner's exported ceiling), and the sample
must be what the count finds left at its end. Each case also has its own expected figures, worked out from its
geometry and from what the upstream code keeps (`EXPECTED`), which the independent count must match too.

Cases:
- qwen3_tts_eager: Qwen3-TTS code2wav, async-chunk decoding on the decoder's eager path (no CUDA-graph wrapper),
  x-vector prompt: it declares nothing; per-request caches, their batched concatenation and its deep copy exist only
  inside a step. Charged to `decoder` (the module whose methods make them), all unexplained.
- qwen3_tts_eager_icl: the same eager path with ICL prompts, two requests batched: the retained per-request caches
  hold the prefix between steps, and the batched concatenation is made by deep-copying the first request's cache and
  assigning its layers' tensors directly (no cache method announces them): counted because a copy is read at its
  release, whatever was assigned to it meanwhile.
- qwen3_tts_wrapper: the same decoder with its CUDA-graph wrapper attached by the real `enable_cudagraph` (every
  capture failed, as none can run here): the decoder declares; ICL prompts; the first chunk's cache is made by its
  child `decoder.pre_transformer` and charged to the declaring `decoder` (its geometry fits); nothing unexplained.
- minicpmo: MiniCPM-o 4.5's streaming Whisper (`thinker.apm`, which declares it) for one duplex session, through the
  duplex runtime: the session keeps its EncoderDecoderCache, growing a chunk per step; nothing unexplained.
- ming_talker: Ming-flash-omni's talker builds a StaticCache per text segment and drops it after: the peak over
  two requests of two segments each is one cache's storage, the sample 0, the declaration explains it.
- mimo: MiMo-Audio's input local transformer makes and drops a DynamicCache on every call; the root (built by its
  real `__init__`, on a real VllmConfig, its staging buffers registered) declares only its other transformer's
  cache, so the input transformer's is its own and all unexplained, and the root shows 0.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.omni.omni_server import CHECKOUT_PATHS, OMNI_030
from tests.support.constants import REPO
from tests.support.scrape import Samples
from tests.support.sidecar import sidecar

RELEASE = OMNI_030  # conftest skips these tests, with the reason, while .venv-omni is not built
HARNESS = "kvx_omni_testplugin.upstream_peaks"
READY_TIMEOUT_S = 600.0  # importing torch and vllm-omni alone took 40-90 s on the shared 2-core machine
# The harness's own constants (it runs in .venv-omni; these are the same numbers, read here to work out figures).
MAX_NUM_SEQS = 4
QWEN_WINDOW, QWEN_CHUNK, QWEN_ICL_PREFIX = 8, 3, 7
MINICPMO_CHUNK_POSITIONS, MINICPMO_CHUNKS = 9, 4

PEAK = "model_local_kv_observed_peak_bytes"
HELD = "model_local_kv_observed_bytes"
UNEXPLAINED = "model_local_kv_unexplained_bytes"
CEILING = "model_local_kv_ceiling_bytes"


class Figures(NamedTuple):
    """One owner's figures: its declared ceiling, the peak, what the sample holds, the unexplained bytes."""

    ceiling: int
    peak: int
    sample: int
    unexplained: int


def qwen_eager(r: dict[str, Any]) -> Figures:
    # x-vector prompt: nothing is retained between chunks (the prefix cache has no positions). The largest step is
    # four requests rolling at the window: each deep-copied working cache then holds the window plus the new chunk
    # (the sliding layer's view keeps the whole concatenated storage alive), one after another in one batch.
    peak = 4 * (QWEN_WINDOW + QWEN_CHUNK) * r["per_position"]
    return Figures(ceiling=0, peak=peak, sample=0, unexplained=peak)


def qwen_eager_icl(r: dict[str, Any]) -> Figures:
    per_position, kept = r["per_position"], QWEN_WINDOW - 1  # a retained slice keeps the sliding view's positions
    # Two requests batched, the largest step going from 5 to 8 suffix frames: both retained slices, their batched
    # concatenation, and its deep copy with the eight suffix frames of both rows added.
    peak = (2 * kept + 2 * kept + (2 * kept + 2 * QWEN_WINDOW)) * per_position
    return Figures(ceiling=0, peak=peak, sample=0, unexplained=peak)


def qwen_wrapper(r: dict[str, Any]) -> Figures:
    per_position, prefix = r["per_position"], QWEN_ICL_PREFIX
    # Two requests at once, decoded one after the other on the wrapper's eager fallback: both retain their prefix
    # cache (7 positions), and the one being decoded deep-copies its own and adds the suffix (window + chunk).
    peak = (prefix + prefix + (prefix + QWEN_WINDOW + QWEN_CHUNK)) * per_position
    # Two declarations (the retained cache and its working copy), window - 1 positions, max_num_seqs rows each.
    ceiling = 2 * MAX_NUM_SEQS * (QWEN_WINDOW - 1) * per_position
    return Figures(ceiling=ceiling, peak=peak, sample=prefix * per_position, unexplained=max(0, peak - ceiling))


def minicpmo(r: dict[str, Any]) -> Figures:
    held = MINICPMO_CHUNKS * MINICPMO_CHUNK_POSITIONS * r["per_position"]  # the session keeps all of it
    return Figures(ceiling=r["capacity_positions"] * r["per_position"], peak=held, sample=held, unexplained=0)


def ming(r: dict[str, Any]) -> Figures:
    return Figures(ceiling=r["static_cache_bytes"], peak=r["static_cache_bytes"], sample=0, unexplained=0)


def mimo(r: dict[str, Any]) -> Figures:
    peak = r["per_row_group"] * max(r["rows_groups"])
    return Figures(ceiling=0, peak=peak, sample=0, unexplained=peak)


EXPECTED: dict[str, Callable[[dict[str, Any]], Figures]] = {
    "qwen3_tts_eager": qwen_eager,
    "qwen3_tts_eager_icl": qwen_eager_icl,
    "qwen3_tts_wrapper": qwen_wrapper,
    "minicpmo": minicpmo,
    "ming_talker": ming,
    "mimo": mimo,
}
CASES = tuple(EXPECTED)


@dataclass
class Run:
    results: dict[str, dict[str, Any]]
    samples: Samples
    harness_log: Path

    def values(self, name: str, case: str) -> dict[str, float]:
        """owner -> value of `name` for the case's engine (ceilings summed over the owner's declarations)."""
        found: dict[str, float] = {}
        for (metric, labels), value in self.samples.items():
            labels_ = dict(labels)
            if metric == name and labels_.get("model_name") == case:
                owner = labels_.get("owner", "")  # an empty label is left out of the page (the root)
                found[owner] = found.get(owner, 0.0) + value
        return found

    def figures(self, case: str, owner: str) -> Figures:
        def one(name: str) -> int:
            return int(self.values(name, case).get(owner, 0))

        return Figures(one(CEILING), one(PEAK), one(HELD), one(UNEXPLAINED))


def wait_ready(process: subprocess.Popen[str], timeout_s: float) -> None:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not selector.select(timeout=min(5.0, max(0.0, deadline - time.monotonic()))):
                continue
            line = process.stdout.readline()
            if not line:
                raise AssertionError(f"the harness exited ({process.wait()}) before it was ready")
            if line.strip() == "READY":
                return
    raise AssertionError(f"the harness was not ready within {timeout_s} s")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """Every case in one harness (its children alive meanwhile), one sidecar over their manifests, one scrape."""
    out = tmp_path_factory.mktemp("upstream-peaks")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": ":".join(map(str, CHECKOUT_PATHS)),  # this checkout's kv_exporter and harness
        "HOME": str(out),
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    log = out / "harness.log"
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            [str(RELEASE.python), "-m", HARNESS, str(out), *CASES],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=REPO,
        )
    try:
        try:
            wait_ready(process, READY_TIMEOUT_S)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{log.read_text(errors='replace')[-6000:]}") from None
        results = {case: json.loads((out / f"{case}.json").read_text()) for case in CASES}
        with sidecar(out, "--manifest-dir", str(out / "manifests"), "--no-nvml") as running:
            samples = running.samples()
        yield Run(results, samples, log)
    finally:
        assert process.stdin is not None
        process.stdin.close()  # the harness's children exit now, removing their manifests
        try:
            code = process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait(10)
    assert code == 0, log.read_text(errors="replace")[-6000:]


@pytest.mark.parametrize("case", CASES)
def test_the_exported_peak_is_the_independent_count_to_the_byte(run: Run, case: str) -> None:
    result = run.results[case]
    assert "error" not in result, (result, run.harness_log.read_text(errors="replace")[-6000:])
    assert result["steps"] >= 2 and result["profile_events"] > 0
    owner = result["expected_owner"]
    figures = run.figures(case, owner)
    # Several steps inside one interval: the most the caches held at any instant, counted independently.
    assert figures.peak == result["independent_peak"] > 0
    assert figures.sample == result["independent_at_sample"]
    assert figures.unexplained == max(0, figures.peak - figures.ceiling)
    # Charged to that owner alone: no other module of the engine shows a peak (the declaring root of MiMo, the
    # decoder's pre_transformer under Qwen3-TTS's wrapper, ...), and nothing is left unattributed.
    others = {o: v for o, v in run.values(PEAK, case).items() if o != owner}
    assert set(others.values()) <= {0.0}, others
    assert figures == EXPECTED[case](result)


@pytest.mark.parametrize("case", CASES)
def test_the_independent_count_follows_from_the_case_s_geometry(run: Run, case: str) -> None:
    """The count the exported figures are held against is itself what the geometry and the upstream code give."""
    result = run.results[case]
    assert "error" not in result, result
    expected = EXPECTED[case](result)
    assert (result["independent_peak"], result["independent_at_sample"]) == (expected.peak, expected.sample)
    assert run.figures(case, result["expected_owner"]).ceiling == expected.ceiling  # the declarations, as exported
    assert expected.unexplained == max(0, expected.peak - expected.ceiling)


def test_what_the_upstream_code_kept_after_the_steps(run: Run) -> None:
    r = run.results
    assert r["qwen3_tts_eager"]["retained_states"] == 0  # every request finished: its state was dropped
    assert r["qwen3_tts_eager_icl"]["retained_states"] == 0
    assert r["qwen3_tts_wrapper"]["captured"] == 0 and r["qwen3_tts_wrapper"]["retained_states"] == 1
    assert r["minicpmo"]["session_cache"] == "EncoderDecoderCache"
    assert r["minicpmo"]["session_positions"] == MINICPMO_CHUNKS * MINICPMO_CHUNK_POSITIONS
    assert r["minicpmo"]["thinker_cache_restored"]  # the runtime puts the thinker's own cache back after each chunk
    assert r["ming_talker"]["segments"] >= 2  # two requests: a StaticCache per segment, one at a time
    assert r["ming_talker"]["creators"] == {"MingAudioGenerator._init_kv_cache": 2 * r["ming_talker"]["segments"]}
    # Under the wrapper, the first ICL chunk's cache is made by the decoder's child (three requests start inside
    # the interval), and charged to the declaring decoder: no series of the child's shows a peak.
    assert r["qwen3_tts_wrapper"]["creators"]["Qwen3TTSTokenizerV2DecoderTransformerModel.forward"] == 3
    assert run.values(PEAK, "qwen3_tts_wrapper").get("decoder.pre_transformer", 0) == 0
    assert r["minicpmo"]["creators"] == {"MiniCPMWhisperEncoder.forward": 3}  # one EncoderDecoderCache and its halves
    assert r["mimo"]["creators"] == {"Qwen2Model.forward": len(r["mimo"]["rows_groups"])}  # one per call
    # The declaring roots are on the page with their ceilings and, where they hold nothing, no unexplained bytes.
    assert run.values(UNEXPLAINED, "mimo").get("") == 0 and run.values(CEILING, "mimo").get("", 0) > 0
    # MiMo's root, built by its real __init__, holds a bf16 staging buffer [100, 1, group_size, hidden] beside its
    # declaration: not KV, so the root shows nothing held and no peak with no cache of its own alive.
    assert r["mimo"]["staging_buffer"] == 100 * 4 * 64 * 2
    assert run.values(HELD, "mimo").get("", 0) == 0 and run.values(PEAK, "mimo").get("", 0) == 0
    assert run.values(CEILING, "qwen3_tts_eager") == {}  # the eager decoder declares nothing
