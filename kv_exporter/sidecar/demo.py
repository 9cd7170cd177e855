"""`kv-exporter demo`: the whole exporter against made-up inputs, in one process.

- an in-process simulated engine serving one vLLM-format metrics page per reference model, whose running count
  moves with time (a slow wave, so nothing needs a background loop);
- manifests for the four reference models (kv_exporter.reference), written by the real writer into a temporary
  folder, plus one deliberately broken file to show how a bad manifest is reported;
- a simulated GPU (clearly labelled `source="simulated"`) whose used memory follows the live rows, as a real
  device's would;
- the exporter itself on its usual port.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kv_exporter.gpu import GpuMemory, GpuScan, SimulatedGpu
from kv_exporter.manifest import (
    Declaration,
    DeviceInfo,
    EngineIdentity,
    Manifest,
    Phase,
    ProcessInfo,
    write_manifest,
)
from kv_exporter.reference import REFERENCE_MODELS, ReferenceModel
from kv_exporter.sidecar.app import DEFAULT_TELEMETRY_PATH, ExporterApp
from kv_exporter.sidecar.collection import Collection, CollectionSettings
from kv_exporter.sidecar.engine_page import EngineTarget
from kv_exporter.sidecar.http import ExporterServer, build_server, serve_in_thread, server_url

GIB = 1 << 30
DEMO_LISTEN_ADDRESS = "127.0.0.1:9477"
DEMO_GPU_TOTAL = 80 * GIB
# What vLLM itself holds at gpu_memory_utilization 0.95 (weights, paged KV, graphs), before model-local rows.
DEMO_GPU_BASE_USED = 76 * GIB
# max_num_seqs per reference model, in REFERENCE_MODELS order.
DEMO_MAX_NUM_SEQS = (256, 64, 16, 8)
WAVE_PERIOD_S = 60.0


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


def demo_engines() -> list[DemoEngine]:
    return [
        DemoEngine(model, seqs, phase=i * math.pi / 2)
        for i, (model, seqs) in enumerate(zip(REFERENCE_MODELS, DEMO_MAX_NUM_SEQS, strict=True))
    ]


def vllm_page(engine: DemoEngine, running: int) -> bytes:
    """A vLLM-format page (the same series names and labels vLLM 0.32 prints) for one engine."""
    name = engine.model.model_name.replace("\\", "\\\\").replace('"', '\\"')
    labels = f'engine="0",model_name="{name}"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {float(running)}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
    ).encode()


def start_simulated_engines(engines: list[DemoEngine], clock: Callable[[], float]) -> ThreadingHTTPServer:
    pages = {f"/{e.slug}/metrics": e for e in engines}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            engine = pages.get(self.path)
            if engine is None:
                self.send_error(404)
                return
            body = vllm_page(engine, engine.running(clock()))
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="demo-engines", daemon=True).start()
    return server


def demo_manifest(engine: DemoEngine, gpu: SimulatedGpu) -> Manifest:
    return Manifest(
        engine=EngineIdentity(model_name=engine.model.model_name),
        process=ProcessInfo.current(),
        device=DeviceInfo(kind="cuda", index=gpu.index, uuid=gpu.uuid),
        max_num_seqs=engine.max_num_seqs,
        phase=Phase.WARMUP,
        collector="kv_exporter",
        declarations=tuple(Declaration.from_spec(owner, spec) for owner, spec in engine.model.declarations),
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
        total = 0
        for engine in self.engines:
            running = engine.running(now)
            for _, spec in engine.model.declarations:
                d = Declaration.from_spec("", spec)
                total += d.bytes_per_row * d.rows_at(running)
        return total

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


BROKEN_MANIFEST = "broken-example.json"


@dataclass
class Demo:
    folder: str
    engines_server: ThreadingHTTPServer
    exporter: ExporterServer
    collection: Collection
    engine_urls: list[str]

    @property
    def url(self) -> str:
        return server_url(self.exporter)

    def close(self) -> None:
        self.exporter.shutdown()
        self.exporter.server_close()
        self.engines_server.shutdown()
        self.engines_server.server_close()
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
    for engine in engines:
        write_manifest(folder, demo_manifest(engine, gpu.gpu))
    with open(os.path.join(folder, BROKEN_MANIFEST), "w") as broken:
        broken.write('{"schema_version": 1, "truncated": ')  # what a crashed non-atomic writer leaves
    engines_server = start_simulated_engines(engines, clock)
    port = engines_server.server_address[1]
    urls = [f"http://127.0.0.1:{port}/{e.slug}/metrics" for e in engines]
    targets = tuple(EngineTarget.parse(u) for u in urls)
    collection = Collection(CollectionSettings(manifest_dir=folder, targets=targets), gpu)
    try:
        exporter = build_server(listen_address, ExporterApp(collection, telemetry_path))
    except BaseException:
        engines_server.shutdown()
        engines_server.server_close()
        collection.close()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    serve_in_thread(exporter)
    return Demo(folder, engines_server, exporter, collection, urls)


def describe(demo: Demo) -> str:
    lines = [
        'kv-exporter demo (everything below is simulated; the GPU series carry source="simulated")',
        f"  landing page:  {demo.url}/",
        f"  metrics:       {demo.url}{demo.exporter.app.telemetry_path}",
        f"  health:        {demo.url}/healthz",
        f"  manifests:     {demo.folder}  (4 reference models + {BROKEN_MANIFEST}, deliberately invalid)",
        *(f"  engine page:   {u}" for u in demo.engine_urls),
        "Press Ctrl-C to stop.",
    ]
    return "\n".join(lines)
