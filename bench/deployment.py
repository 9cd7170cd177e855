"""The deployment the benchmarks scrape: manifests written by the real writer, each worker's step record written by
the hook's own writer as its steps run (bench/engines.py), engine pages built from the recorded real vLLM 0.32 page
(read only where a benchmark asks: the running count comes from the records), and the `Layout` that ties them
together.

A layout is `gpus` GPUs x `stages` stages, one worker per (stage, GPU) (tensor parallel across the GPUs), each
worker declaring `per_worker` caches; each stage is one engine serving one metrics page. The running count on a
stage's page is the vllm-omni per-stage series (`vllm:num_requests_running{model_name,replica,stage}`) put in
place of the recorded vLLM series; every other line of the ~600-line page is as recorded.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.benchlib import Children, module_argv, read_json_line, wait_until_serving
from kv_exporter.manifest import (
    Declaration,
    DeviceInfo,
    EngineIdentity,
    Manifest,
    Phase,
    ProcessInfo,
    current_pid_namespace,
    process_start_ticks,
    read_manifest,
    write_manifest,
)
from kv_exporter.observation import Observation, ObservationState, OwnerObservation
from kv_exporter.plugin.settings import DEFAULT_OBSERVE_INTERVAL_S
from kv_exporter.reference import REFERENCE_MODELS
from kv_exporter.sidecar.engine_page import STAGE_SERIES
from tests.support.constants import REPO, SIMULATE_GPU, gpu_uuid
from tests.support.pages import vllm_page_with
from tests.support.sidecar import Sidecar
from tests.support.sidecar import start_sidecar as start_sidecar_process

MODEL = "bench-omni"
MAX_NUM_SEQS = 64

# Every reference declaration (7 specs over 4 models), cycled to make up a worker's caches.
REFERENCE_DECLARATIONS = tuple(
    Declaration.from_spec(owner, spec) for model in REFERENCE_MODELS for owner, spec in model.declarations
)


@dataclass(frozen=True)
class Layout:
    """`workers` workers (one manifest each) dealt round-robin over the stages, then over the GPUs."""

    workers: int
    per_worker: int
    stages: int = 3
    gpus: int = 8

    @property
    def declarations(self) -> int:
        return self.workers * self.per_worker

    def place(self, worker: int) -> tuple[int, int, int]:
        """(stage, tensor-parallel rank, GPU) of a worker."""
        stage, rank = worker % self.stages, worker // self.stages
        return stage, rank, rank % self.gpus

    @property
    def gpus_used(self) -> int:
        return len({self.place(worker)[2] for worker in range(self.workers)})

    @property
    def stages_used(self) -> int:
        return len({self.place(worker)[0] for worker in range(self.workers)})


# Target 1: 8 GPUs x 3 stages x 6 declarations (144), one worker per (stage, GPU), three engine pages.
SCRAPE_LAYOUT = Layout(workers=24, per_worker=6)


def scaling_layout(declarations: int, per_worker: int = 10) -> Layout:
    """`declarations` caches, `per_worker` a worker (fewer if that is all there are)."""
    per_worker = min(per_worker, declarations)
    if declarations % per_worker:
        raise ValueError(f"{declarations} is not a multiple of {per_worker}")
    return Layout(workers=declarations // per_worker, per_worker=per_worker)


def worker_declarations(rank: int, gpus: int, count: int) -> tuple[Declaration, ...]:
    """`count` caches: the reference declarations in turn. Tensor-parallel ranks on different GPUs share owner
    paths, as in a real model; ranks sharing a GPU and repeats within a worker get unique ones."""
    result = []
    for i in range(count):
        base = REFERENCE_DECLARATIONS[i % len(REFERENCE_DECLARATIONS)]
        cycle = i // len(REFERENCE_DECLARATIONS)
        shared = cycle == 0 and rank < gpus
        owner = base.owner if shared else f"blocks.{rank}.{cycle}.{base.owner}"
        result.append(dataclasses.replace(base, owner=owner))
    return tuple(result)


def observation_of(declarations: Sequence[Declaration], taken_at: float) -> Observation:
    """A worker's sample as the hook would take it: each declaring owner holding its caches at half of
    max_num_seqs (fixed ones in full), plus an undeclared owner and caches no module made."""
    held: dict[str, tuple[int, int]] = {}
    for d in declarations:
        rows = d.rows_at(MAX_NUM_SEQS // 2)
        bytes_held, caches = held.get(d.owner, (0, 0))
        held[d.owner] = (bytes_held + rows * d.bytes_per_row, caches + rows)
    held["blocks.extra.scratch"] = (1 << 20, 1)
    held["unattributed"] = (1 << 16, 1)
    owners = tuple(OwnerObservation(owner, bytes_held, caches) for owner, (bytes_held, caches) in sorted(held.items()))
    interval = DEFAULT_OBSERVE_INTERVAL_S
    return Observation(ObservationState.OK, "", interval, taken_at, 0.002, owners, peaks_followed=True)


def refresh_observations(folder: Path) -> int:
    """Rewrite every manifest in `folder` with a new sample time, as each worker's sampler does every interval."""
    now = time.time()
    rewritten = 0
    for path in sorted(folder.glob("*.json")):
        manifest = read_manifest(path)
        if manifest.observation is not None:
            sample = dataclasses.replace(manifest.observation, taken_at=now)
            write_manifest(folder, dataclasses.replace(manifest, observation=sample, written_at=now))
            rewritten += 1
    return rewritten


def write_deployment(folder: Path, layout: Layout, pid: int, observed: bool = False) -> int:
    """One manifest per worker, all owned by the live process `pid` (so the liveness check passes on /proc);
    `observed`: each carries a sample (`observation_of`), which `refresh_observations` keeps fresh.

    Returns the number of declarations written.
    """
    process = ProcessInfo(
        pid=pid, start_time_ticks=process_start_ticks(pid), pid_namespace=current_pid_namespace(), hostname="bench"
    )
    written = 0
    for worker in range(layout.workers):
        stage, rank, gpu = layout.place(worker)
        declarations = worker_declarations(rank, layout.gpus, layout.per_worker)
        manifest = Manifest(
            engine=EngineIdentity(model_name=MODEL, stage=stage, engine_index=0, tp_rank=rank),
            process=process,
            device=DeviceInfo(kind="cuda", index=gpu, uuid=gpu_uuid(gpu)),
            max_num_seqs=MAX_NUM_SEQS,
            phase=Phase.WARMUP,
            collector="kv_exporter",
            declarations=declarations,
            written_at=1_764_480_000.0,
            observation=observation_of(declarations, time.time()) if observed else None,
        )
        write_manifest(folder, manifest)
        written += layout.per_worker
    return written


def stage_page(stage: int, running: int) -> bytes:
    """The recorded vLLM 0.32 page for `MODEL`, its running series relabelled as vllm-omni's stage `stage`."""
    page = vllm_page_with(running, MODEL)
    old = f'{STAGE_SERIES.name.decode()}{{engine="0",model_name="{MODEL}"}} {running}.0'.encode()
    new = f'{STAGE_SERIES.name.decode()}{{model_name="{MODEL}",replica="0",stage="{stage}"}} {running}.0'.encode()
    if page.count(old) != 1:
        raise RuntimeError("the recorded page changed: update bench.deployment")
    return page.replace(old, new)


# -- running it --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Running:
    """A started deployment: the engines' process, the sidecar, its manifest folder."""

    engines: subprocess.Popen[bytes]
    engine_ports: tuple[int, ...]
    sidecar: Sidecar
    folder: Path
    pages: bool = False  # the sidecar reads the engines' pages too (each stage's engine on its page)

    @property
    def port(self) -> int:
        return self.sidecar.port


def start_engines(
    kids: Children, stages: int, refresh: Path | None = None, steps: Sequence[Path] = ()
) -> tuple[subprocess.Popen[bytes], tuple[int, ...]]:
    """`refresh`: a manifest folder whose observations the engines' process keeps fresh (`refresh_observations`);
    `steps`: manifest folders whose workers it steps, each keeping its step record."""
    more = [*(("--refresh-observations", str(refresh)) if refresh else ())]
    more += [arg for folder in steps for arg in ("--step-records", str(folder))]
    proc = kids.start(module_argv("engines", "--stages", str(stages), *more), stdout=subprocess.PIPE)
    ready = read_json_line(proc)
    return proc, tuple(ready["ports"])


def start_deployment(
    kids: Children,
    layout: Layout,
    folder: Path,
    extra: Sequence[str] = (),
    refresh: Path | None = None,
    pages: bool = False,
) -> Running:
    """Engines, manifests, the workers' step records, and the sidecar serving them (`extra`: more `serve` options;
    `pages`: it reads the engines' pages too, `--engine-url`); checked to export what the layout declares. `refresh`:
    as for `start_engines`; its folder's workers are stepped too."""
    manifests = folder / "manifests"
    engines, engine_ports = start_engines(kids, layout.stages, refresh, [manifests, *([refresh] if refresh else [])])
    write_deployment(manifests, layout, engines.pid)
    wait_for_records(manifests, layout.workers)
    sidecar = start_sidecar(kids, layout, folder, engines.pid, engine_ports if pages else (), extra)
    running = Running(engines, engine_ports, sidecar, folder, pages)
    verify(running, layout)
    return running


def start_sidecar(
    kids: Children,
    layout: Layout,
    folder: Path,
    engine_pid: int,
    engine_ports: Sequence[int],
    extra: Sequence[str] = (),
    source: Path | None = None,
) -> Sidecar:
    """The 8-GPU sidecar (bench.sidecar) on `folder`/manifests, once it answers; `source`: another copy of the package
    (from `source_at`) to run instead of the checkout's. Its log goes to `folder`/sidecar-N.log."""
    gpus = ("--gpus", str(layout.gpus), "--engine-pid", str(engine_pid), "--")
    args = ["--manifest-dir", str(folder / "manifests"), *SIMULATE_GPU]
    args += [a for port in engine_ports for a in ("--engine-url", f"http://127.0.0.1:{port}/metrics")]
    env = None
    if source:  # it runs in that copy's folder, which Python searches first; the checkout adds bench and tests
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    entry = ("-m", "bench.sidecar", *gpus)
    sidecar = start_sidecar_process(folder, *args, *extra, entry=entry, cwd=source or REPO, env=env, timeout_s=300)
    kids.track(sidecar.process)
    wait_until_serving("127.0.0.1", sidecar.port, timeout_s=300)
    return sidecar


def wait_for_records(folder: Path, workers: int, timeout_s: float = 60.0) -> None:
    """Until every worker in `folder` keeps its step record (the engines' process attaches to new manifests)."""
    deadline = time.monotonic() + timeout_s
    while len(list(folder.glob("*.steps"))) < workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"step records missing in {folder}")
        time.sleep(0.05)


def source_at(ref: str, folder: Path) -> Path:
    """The package as it was at git `ref`, unpacked under `folder` (read-only git: `git archive`)."""
    target = folder / f"source-{ref.replace('/', '_')}"
    target.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "kv_exporter"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def pages_served(running: Running) -> int:
    """Engine pages served so far, all engines together: each collection fetches every page once."""
    total = 0
    for port in running.engine_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/served", timeout=10) as response:
            total += int(response.read())
    return total


def text_page(port: int) -> str:
    """The exporter's page in the classic text format (for parsing; the benchmarks scrape as Prometheus does)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=120) as response:
        return response.read().decode()  # type: ignore[no-any-return]


def verify(running: Running, layout: Layout) -> None:
    """Refuse to time a deployment the sidecar does not see whole: every declaration, engine and GPU."""
    text = text_page(running.port)
    expected = {
        "model_local_kv_bytes_per_row{": {layout.declarations},
        # An engine is seen where a worker keeps its record, or, where pages are read, on its stage's page.
        "model_local_kv_engine_up{": {layout.stages if running.pages else layout.stages_used},
        # Every GPU an engine uses (a baseline from before issue 38 exports every GPU of the node).
        "model_local_kv_gpu_headroom_bytes{": {layout.gpus_used, layout.gpus},
        "model_local_kv_gpu_process_memory_bytes{": {layout.gpus_used},
    }
    for prefix, counts in expected.items():
        found = sum(1 for line in text.splitlines() if line.startswith(prefix))
        if found not in counts:
            raise RuntimeError(f"sidecar exports {found} {prefix}...}} series, expected {counts}; see {running.folder}")
    down = [
        line for line in text.splitlines() if line.startswith("model_local_kv_engine_up{") and line.endswith(" 0.0")
    ]
    if down:
        raise RuntimeError(f"engines not read: {down}")
    absent = [
        line
        for line in text.splitlines()
        if line.startswith("model_local_kv_running_state{") and line.endswith('state="absent"} 1.0')
    ]
    if absent:
        raise RuntimeError(f"workers without a step record: {absent}")
