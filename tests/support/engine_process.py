"""Simulated engines (kv_exporter.sidecar.simulated_engine) in a process of their own, whose pid manifests can name.

`serve_until_terminated` is the main loop of such a process; run as a module, this file is the stand-in engine of
the restart tests: it publishes one manifest per rank through the real writer, with its own pid and start time (so
the sidecar checks it in /proc), serves the recorded vLLM page with its running count on 127.0.0.1:PORT, and on
SIGTERM removes its manifests, as the hook does on a clean exit.

    python -m tests.support.engine_process FOLDER PORT RUNNING RANKS
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kv_exporter.manifest import write_manifest
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.support.constants import REPO
from tests.support.manifests import live_manifest
from tests.support.pages import vllm_page_with
from tests.support.sidecar import stop_process


def serve_until_terminated(engines: Sequence[SimulatedEngine]) -> None:
    """Print `{"pid": ..., "ports": [...]}` on one line once serving, serve until SIGTERM, then stop the engines."""
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: terminated.set())
    print(json.dumps({"pid": os.getpid(), "ports": [engine.port for engine in engines]}), flush=True)
    try:
        while not terminated.wait(1.0):
            pass
    finally:
        for engine in engines:
            engine.stop()


def main(folder: str, port: int, running: int, ranks: int) -> int:
    base = live_manifest()
    paths = [
        write_manifest(folder, dataclasses.replace(base, engine=dataclasses.replace(base.engine, tp_rank=rank)))
        for rank in range(ranks)
    ]
    try:
        serve_until_terminated([SimulatedEngine(vllm_page_with(running, base.engine.model_name), port=port)])
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
    return 0


def ready_line(process: subprocess.Popen[str]) -> dict[str, Any]:
    """The line a process running `serve_until_terminated` prints once it serves."""
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"engine process {process.pid} exited before serving ({process.poll()})"
    ready: dict[str, Any] = json.loads(line)
    return ready


@contextmanager
def engine_process(folder: Path, port: int, running: int, ranks: int) -> Iterator[subprocess.Popen[str]]:
    """This module as a process (see above); SIGKILLed by its pid at the end if still running."""
    args = [str(folder), str(port), str(running), str(ranks)]
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.support.engine_process", *args], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        ready_line(process)
        yield process
    finally:
        stop_process(process, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
