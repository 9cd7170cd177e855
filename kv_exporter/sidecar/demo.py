"""`kv-exporter demo`: the whole exporter against made-up inputs, in one process.

- an in-process simulated engine (kv_exporter.sidecar.simulated_engine) serving one vLLM-format metrics page per
  reference model, whose running count moves with time (a slow wave), shown late as vLLM's own page shows it;
- a step record per worker (kv_exporter.steprecord), written by a thread "stepping" every STEP_S with the running
  count of that instant, as the hook's writer does at every step; the last model's worker keeps none (an older
  hook), so its running count comes from its page;
- manifests for the four reference models (kv_exporter.reference), written by the real writer into a temporary
  folder, plus one deliberately broken file to show how a bad manifest is reported;
- an observer that rewrites each manifest every few seconds with what its caches "hold", as the hook's sampler
  does: the declared rows at the running count, except that Qwen3-TTS's sliding window stores its whole window
  (72 positions where 71 are declared, docs/cache-bytes.md) and ming_flash_omni keeps a cache nobody declared;
- a simulated GPU (clearly labelled `source="simulated"`) whose used memory follows what the caches hold, as a real
  device's would;
- the exporter itself on its usual port.
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kv_exporter.engine_memory import EngineMemory
from kv_exporter.gpu import GpuMemory, GpuScan, SimulatedGpu
from kv_exporter.manifest import (
    Declaration,
    DeviceInfo,
    EngineIdentity,
    Manifest,
    Phase,
    ProcessInfo,
    manifest_filename,
    write_manifest,
)
from kv_exporter.observation import CudaMemory, Observation, ObservationState, OwnerObservation
from kv_exporter.reference import MING_FLASH_OMNI, QWEN3_TTS, REFERENCE_MODELS, ReferenceModel
from kv_exporter.sidecar.app import DEFAULT_TELEMETRY_PATH, ExporterApp
from kv_exporter.sidecar.collection import Collection, CollectionSettings
from kv_exporter.sidecar.engine_page import EngineTarget
from kv_exporter.sidecar.report import DEMO_BROKEN_MANIFEST
from kv_exporter.sidecar.server import DEMO_LISTEN_ADDRESS, ExporterServer, build_server, serve_in_thread, server_url
from kv_exporter.sidecar.simulated_engine import SimulatedEngine, vllm_page
from kv_exporter.steprecord import RecordWriter, new_record, record_name

GIB = 1 << 30
DEMO_GPU_TOTAL = 80 * GIB
# What vLLM itself holds at gpu_memory_utilization 0.95 (weights, paged KV, graphs), before model-local rows.
DEMO_GPU_BASE_USED = 76 * GIB
# max_num_seqs per reference model, in REFERENCE_MODELS order.
DEMO_MAX_NUM_SEQS = (256, 64, 16, 8)
WAVE_PERIOD_S = 60.0
DEMO_OBSERVE_INTERVAL_S = 5.0
PEAK_STEP_S = 0.1  # the demo's "steps": how finely its peak between samples is looked for
STEP_S = 0.1  # how often the demo's workers write a step into their records
PAGE_LAG_S = 2.0  # how late the pages show the running count (vLLM's own page lags the worker)
RECORDED = 3  # the first three models' workers keep a step record; the last one's hook is older
# Where the demo's caches hold other than their declarations say (everything else holds exactly the declared rows).
STORED_POSITIONS = {QWEN3_TTS.model_name: 72}  # a sliding layer's storage keeps the whole window
UNDECLARED = {MING_FLASH_OMNI.model_name: ("talker.vocoder", 8 << 20)}  # owner, bytes: one cache, never declared
# Each demo engine as vLLM 0.34 runs it: its KV cache sized after warm-up (extensible), its allocator capped at what it
# reserves for weights, activations and graphs, plus its declared ceiling, plus DEMO_CAP_ROOM.
DEMO_KV_CACHE = 12 * GIB
DEMO_KV_BLOCK = 2 << 20
DEMO_TORCH_BASE = 6 * GIB
DEMO_CAP_ROOM = 512 << 20


@dataclass(frozen=True)
class DemoEngine:
    model: ReferenceModel
    max_num_seqs: int
    phase: float  # where on the wave this engine starts

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.model.model_name.lower())

    def running(self, now: float) -> int:
        wave = 0.5 * (1 + math.sin(2 * math.pi * now / WAVE_PERIOD_S + self.phase))
        return round(wave * self.max_num_seqs)

    def held(self, now: float) -> tuple[OwnerObservation, ...]:
        """What this engine's caches hold at `now`, per owner (its declared rows at the running count), and the most
        they held since the sample before, as a worker following the peak (the default) reports it:
        the running count is a function of time, so its most over the interval is found at PEAK_STEP_S apart."""
        at_sample = self._held_at(self.running(now))
        steps = round(DEMO_OBSERVE_INTERVAL_S / PEAK_STEP_S)
        most = max(self.running(now - i * PEAK_STEP_S) for i in range(steps + 1))
        peak = self._held_at(most)
        return tuple(
            OwnerObservation(owner, size, caches, max(size, peak[owner][0]))
            for owner, (size, caches) in at_sample.items()
        )

    def cuda(self, held: tuple[OwnerObservation, ...]) -> CudaMemory:
        """torch's allocator in this engine's worker: its base plus what the caches hold, under its cap."""
        reserved = DEMO_TORCH_BASE + sum(owner.bytes for owner in held)
        ceiling = sum(Declaration.from_spec(o, s).peak_bytes(self.max_num_seqs) for o, s in self.model.declarations)
        limit = DEMO_TORCH_BASE + ceiling + DEMO_CAP_ROOM
        return CudaMemory(reserved, reserved, reserved, reserved, reserved, limit_bytes=max(limit, reserved))

    def _held_at(self, running: int) -> dict[str, list[int]]:
        owners: dict[str, list[int]] = {}
        for owner, spec in self.model.declarations:
            d = Declaration.from_spec(owner, spec)
            stored = STORED_POSITIONS.get(self.model.model_name, d.physical_capacity_positions)
            tally = owners.setdefault(owner, [0, 0])
            tally[0] += d.rows_at(running) * d.bytes_per_row * stored // d.physical_capacity_positions
            tally[1] += d.rows_at(running)  # one cache object a row, as per-request caches are
        if self.model.model_name in UNDECLARED:
            owner, size = UNDECLARED[self.model.model_name]
            owners[owner] = [size, 1]
        return owners


def demo_engines() -> list[DemoEngine]:
    return [
        DemoEngine(model, seqs, phase=i * math.pi / 2)
        for i, (model, seqs) in enumerate(zip(REFERENCE_MODELS, DEMO_MAX_NUM_SEQS, strict=True))
    ]


def start_simulated_engines(engines: list[DemoEngine], clock: Callable[[], float]) -> SimulatedEngine:
    """One simulated engine serving each demo engine's page at /SLUG/metrics, its running count read per request."""

    def page(engine: DemoEngine) -> Callable[[], bytes]:
        return lambda: vllm_page(engine.model.model_name, engine.running(clock() - PAGE_LAG_S))

    return SimulatedEngine({f"/{e.slug}/metrics": page(e) for e in engines})


def demo_manifest(engine: DemoEngine, gpu: SimulatedGpu) -> Manifest:
    return Manifest(
        engine=EngineIdentity(model_name=engine.model.model_name),
        process=ProcessInfo.current(),
        device=DeviceInfo(kind="cuda", index=gpu.index, uuid=gpu.uuid),
        max_num_seqs=engine.max_num_seqs,
        phase=Phase.WARMUP,
        collector="kv_exporter",
        declarations=tuple(Declaration.from_spec(owner, spec) for owner, spec in engine.model.declarations),
        engine_memory=EngineMemory(DEMO_KV_CACHE, DEMO_KV_CACHE // DEMO_KV_BLOCK, 1.0, True),
    )


class DemoGpu:
    """A SimulatedGpu whose used memory is the base plus the rows the demo engines hold right now."""

    def __init__(self, engines: list[DemoEngine], clock: Callable[[], float]) -> None:
        self.engines = engines
        self.clock = clock
        self.gpu = SimulatedGpu(total=DEMO_GPU_TOTAL, used=DEMO_GPU_BASE_USED)

    @property
    def source(self) -> str:
        return self.gpu.source

    @property
    def pid_namespace(self) -> str | None:
        return self.gpu.pid_namespace

    def live_bytes(self) -> int:
        now = self.clock()
        return sum(owner.bytes for engine in self.engines for owner in engine.held(now))

    def _refresh(self) -> None:
        held = self.live_bytes()
        self.gpu.used = min(self.gpu.total, DEMO_GPU_BASE_USED + held)
        # The demo's engines all live in this process: NVML would list it with what it holds.
        self.gpu.processes = {os.getpid(): held}

    def scan(self) -> GpuScan:
        self._refresh()
        return self.gpu.scan()

    def device(self, index: int) -> GpuMemory:
        self._refresh()
        return self.gpu.device(index)

    def process_memory(self, index: int) -> dict[int, int]:
        self._refresh()
        return self.gpu.process_memory(index)


@dataclass
class Observer:
    """Rewrites each demo manifest with a fresh observation every DEMO_OBSERVE_INTERVAL_S, as the hook's sampler."""

    folder: str
    manifests: list[tuple[DemoEngine, Manifest]]
    clock: Callable[[], float]
    stopped: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def observe(self) -> None:
        now = self.clock()
        for engine, manifest in self.manifests:
            held = engine.held(now)
            cuda = engine.cuda(held)
            sample = Observation(
                ObservationState.OK, "", DEMO_OBSERVE_INTERVAL_S, now, 0.0, held, cuda, peaks_followed=True
            )
            write_manifest(self.folder, replace(manifest, observation=sample, written_at=now))

    def start(self) -> None:
        def loop() -> None:
            while not self.stopped.wait(DEMO_OBSERVE_INTERVAL_S):
                self.observe()

        self.observe()
        self.thread = threading.Thread(target=loop, name="demo-observer", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()  # before the folder goes: a last write would make it again


class Stepper:
    """Each recorded engine's worker "steps" every STEP_S with the running count of that instant (none while it is
    0): its step record is written as the hook's writer writes it."""

    def __init__(self, folder: str, workers: list[tuple[DemoEngine, Manifest]], clock: Callable[[], float]) -> None:
        self.clock = clock
        self.stopped = threading.Event()
        self.writers: list[tuple[DemoEngine, RecordWriter, memoryview, mmap.mmap]] = []
        for engine, manifest in workers:
            path = os.path.join(folder, record_name(manifest_filename(manifest.engine)))
            with open(path, "wb") as out:
                out.write(new_record(manifest.process.pid, manifest.process.start_time_ticks))
            with open(path, "r+b") as mapped:
                mapping = mmap.mmap(mapped.fileno(), 0)
            view = memoryview(mapping)
            self.writers.append((engine, RecordWriter(view), view, mapping))
        self.thread = threading.Thread(target=self._loop, name="demo-steps", daemon=True)

    def step(self) -> None:
        now = self.clock()
        for engine, writer, _, _ in self.writers:
            running = engine.running(now)
            if running:  # an idle engine runs no step
                writer.begin(running)
                writer.end()

    def _loop(self) -> None:
        while not self.stopped.wait(STEP_S):
            self.step()

    def start(self) -> None:
        self.step()
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()
        for _, _, view, mapping in self.writers:
            view.release()
            mapping.close()


@dataclass
class Demo:
    folder: str
    engines: SimulatedEngine
    exporter: ExporterServer
    collection: Collection
    engine_urls: list[str]
    observer: Observer
    stepper: Stepper

    @property
    def url(self) -> str:
        return server_url(self.exporter)

    def close(self) -> None:
        self.observer.stop()
        self.stepper.stop()
        self.exporter.shutdown()
        self.exporter.server_close()
        self.engines.stop()
        self.collection.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_demo(
    listen_address: str = DEMO_LISTEN_ADDRESS,
    telemetry_path: str = DEFAULT_TELEMETRY_PATH,
    clock: Callable[[], float] = time.time,
) -> Demo:
    engines = demo_engines()
    gpu = DemoGpu(engines, clock)
    folder = tempfile.mkdtemp(prefix="kv-exporter-demo-")
    observer = Observer(folder, [(engine, demo_manifest(engine, gpu.gpu)) for engine in engines], clock)
    observer.start()
    stepper = Stepper(folder, observer.manifests[:RECORDED], clock)
    stepper.start()
    with open(os.path.join(folder, DEMO_BROKEN_MANIFEST), "w") as broken:
        broken.write('{"schema_version": 1, "truncated": ')  # what a crashed non-atomic writer leaves
    simulated = start_simulated_engines(engines, clock)
    urls = [simulated.url_for(path) for path in simulated.pages]
    targets = tuple(EngineTarget.parse(u) for u in urls)
    collection = Collection(CollectionSettings(manifest_dir=folder, targets=targets), gpu)
    try:
        exporter = build_server(listen_address, ExporterApp(collection, telemetry_path))
    except BaseException:
        observer.stop()
        stepper.stop()
        simulated.stop()
        collection.close()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    serve_in_thread(exporter)
    return Demo(folder, simulated, exporter, collection, urls, observer, stepper)


def describe(demo: Demo) -> str:
    lines = [
        'kv-exporter demo (everything below is simulated; the GPU series carry source="simulated")',
        f"  landing page:  {demo.url}/",
        f"  metrics:       {demo.url}{demo.exporter.app.telemetry_path}",
        f"  health:        {demo.url}/healthz",
        f"  manifests:     {demo.folder}  (4 reference models + {DEMO_BROKEN_MANIFEST}, deliberately invalid; "
        f"step records for {RECORDED} of them)",
        f"  report:        kv-exporter report {demo.folder}  (exits 1 for the invalid example, as expected)",
        *(f"  engine page:   {u}" for u in demo.engine_urls),
        "Press Ctrl-C to stop.",
    ]
    return "\n".join(lines)
