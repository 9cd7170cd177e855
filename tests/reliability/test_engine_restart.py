"""An engine killed and restarted with new pids (and fewer ranks), against the real sidecar process: real engine
processes publishing through the real writer, checked by the sidecar in /proc."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.reliability.sidecar import (
    MODEL,
    REPO,
    SIMULATED_GPU,
    Sidecar,
    ceiling_bytes,
    live_manifest,
    sidecar,
)
from tests.unit.test_server import Samples, absent, pick


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def engine_process(folder: Path, port: int, running: int, ranks: int) -> Iterator[subprocess.Popen[str]]:
    args = [str(folder), str(port), str(running), str(ranks)]
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.engine_process", *args], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("ready"), "engine did not start"
        yield process
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait(10)


def states(s: Samples) -> tuple[float, ...]:
    return tuple(pick(s, "model_local_kv_manifests", state=x) for x in ("live", "stale", "invalid"))


def declared_ceiling(s: Samples) -> float:
    return sum(v for (n, _), v in s.items() if n == "model_local_kv_ceiling_bytes")


def landing(sc: Sidecar) -> str:
    status, _, body = sc.get("/")
    assert status == 200
    return body.decode()


def test_engine_restarted_with_new_pids_and_fewer_ranks(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    one_rank = ceiling_bytes(live_manifest())
    args = ("--manifest-dir", str(folder), "--engine-url", url, "--engine-timeout", "1", *SIMULATED_GPU)
    with sidecar(tmp_path, *args) as sc:
        with engine_process(folder, port, running=5, ranks=2) as first:
            s = sc.samples()
            assert states(s) == (2, 0, 0)
            assert pick(s, "model_local_kv_engine_manifests", model_name=MODEL) == 2
            assert pick(s, "model_local_kv_running_sequences", model_name=MODEL) == 5
            assert declared_ceiling(s) == 2 * one_rank  # two ranks on one GPU: their bytes add up
            assert f"process {first.pid} is running" in landing(sc)

            os.kill(first.pid, signal.SIGKILL)  # a hard kill leaves its manifests behind
            first.wait(10)
            s = sc.samples()
            assert states(s) == (0, 2, 0)
            assert absent(s, "model_local_kv_ceiling_bytes")  # a dead engine's declarations do not count
            assert absent(s, "model_local_kv_engine_up")
            assert pick(s, "model_local_kv_engine_page_up", target=url) == 0
            assert landing(sc).count(f"process {first.pid} is gone") == 2

        with engine_process(folder, port, running=9, ranks=1) as second:
            assert second.pid != first.pid
            s = sc.samples()
            assert states(s) == (1, 1, 0)  # rank 0 overwritten by the new pid; rank 1 is a leftover
            assert pick(s, "model_local_kv_engine_manifests", model_name=MODEL) == 1
            assert pick(s, "model_local_kv_engine_up", model_name=MODEL) == 1
            assert pick(s, "model_local_kv_running_sequences", model_name=MODEL) == 9
            assert declared_ceiling(s) == one_rank
            page = landing(sc)
            assert f"process {second.pid} is running" in page and f"process {first.pid} is gone" in page

            os.kill(second.pid, signal.SIGTERM)  # a clean exit removes its manifest
            assert second.wait(10) == 0
        assert states(sc.samples()) == (0, 1, 0)
        assert sc.stop() == 0
