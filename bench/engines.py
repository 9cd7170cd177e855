"""Helper process: stand-in engines, one simulated engine (kv_exporter.sidecar.simulated_engine) per stage on
127.0.0.1, each serving the recorded real vLLM page (~600 lines) with that stage's running count, which moves on
every request (so nothing can be cached); and the stand-in workers' steps: for every manifest in a `--step-records`
folder, the hook's own step record (`kv_exporter.plugin.steps`, its C writer), written every STEP_S with that
stage's batch, which moves on every step (all ranks of a stage run the same batch).

`python -m bench.engines --stages 3 [--refresh-observations FOLDER] [--step-records FOLDER ...]` prints one JSON
line `{"pid": ..., "ports": [...]}` once serving, then runs until SIGTERM. Its pid is the one the benchmark manifests
name, so they pass the sidecar's liveness check; with FOLDER it also rewrites the observations there every interval,
as workers do.

The pages are prebuilt and the stand-in reads no more of a request than its first line, so an engine answers in
well under a millisecond: what the benchmarks time is the sidecar, not the stand-in. (A real vLLM server renders
its page with prometheus_client on every request, ~10-20 ms on these cores; that time adds to any scrape of a
sidecar reading it, whatever the sidecar does.)
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from bench.deployment import MAX_NUM_SEQS, refresh_observations, stage_page
from kv_exporter.manifest import ProcessInfo, is_manifest_name, read_manifest
from kv_exporter.plugin import steps
from kv_exporter.plugin.settings import DEFAULT_OBSERVE_INTERVAL_S
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.support.engine_process import serve_until_terminated


class StagePages:
    """One stage's pages; each request gets the next running count (a prime stride through 0..max_num_seqs)."""

    def __init__(self, stage: int) -> None:
        self.pages = [stage_page(stage, running) for running in range(MAX_NUM_SEQS + 1)]
        self.served = 0
        self._lock = threading.Lock()  # requests are answered on threads of their own

    def next_page(self) -> bytes:
        with self._lock:
            count, self.served = self.served, self.served + 1
        return self.pages[(count * 7) % len(self.pages)]

    def served_page(self) -> bytes:
        """How many pages this engine has served (benchmarks count collections with it)."""
        return str(self.served).encode()


def stage_engine(stage: int) -> SimulatedEngine:
    pages = StagePages(stage)
    return SimulatedEngine({"/metrics": pages.next_page, "/served": pages.served_page})


def keep_fresh(folder: Path) -> None:
    """Every interval, rewrite the observations in `folder` with a new sample time, as the workers' samplers do."""

    def run() -> None:
        while True:
            time.sleep(DEFAULT_OBSERVE_INTERVAL_S)
            refresh_observations(folder)

    threading.Thread(target=run, name="observations", daemon=True).start()


STEP_S = 0.01  # a decode step of a busy GPU engine: tens of milliseconds; here faster, so every scrape sees a new one
LOOK_S = 0.5  # how often the folders are looked at for new manifests


class Output:
    """A scheduler output: what the hook's writer reads of one (`num_scheduled_tokens`)."""

    def __init__(self, sequences: int) -> None:
        self.num_scheduled_tokens = dict.fromkeys(range(sequences), 1)


class Worker:
    """A stand-in model runner whose steps the hook's writer records, as it records a real runner's."""

    def execute_model(self, scheduler_output: Output) -> None:
        return None


def step_workers(folders: list[Path]) -> None:
    """Attach a stand-in worker to each manifest that appears in `folders`, and step them all every STEP_S."""
    outputs = [Output(n) for n in range(MAX_NUM_SEQS + 1)]
    process = ProcessInfo.current()
    workers: dict[Path, tuple[Worker, int]] = {}  # manifest -> its worker and stage
    looked, step = 0.0, 0
    while True:
        if time.monotonic() - looked > LOOK_S:
            looked = time.monotonic()
            for folder in folders:
                for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
                    if path not in workers and is_manifest_name(path.name):
                        worker = Worker()
                        steps.attach(worker, path, process)
                        workers[path] = (worker, read_manifest(path).engine.stage)
        step += 1
        for worker, stage in workers.values():
            worker.execute_model(outputs[(step * 7 + stage * 11) % len(outputs)])
        time.sleep(STEP_S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--refresh-observations", type=Path, metavar="FOLDER", help="keep these samples fresh")
    parser.add_argument(
        "--step-records", type=Path, action="append", default=[], metavar="FOLDER", help="step the workers here"
    )
    args = parser.parse_args()
    if args.refresh_observations:
        keep_fresh(args.refresh_observations)
    if args.step_records:
        threading.Thread(target=step_workers, args=(args.step_records,), name="steps", daemon=True).start()
    serve_until_terminated([stage_engine(stage) for stage in range(args.stages)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
