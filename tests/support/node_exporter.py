"""Debian's prometheus-node-exporter on 127.0.0.1, the reference for how an exporter-toolkit server answers: Go's
net/http behind the same toolkit the sidecar follows; and a peer the benchmarks time. On a free port, stopped by its
pid; the tests start it with no collectors (only its own Go metrics). scripts/ensure-system-deps.sh installs it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests.support.net import free_port
from tests.support.sidecar import stop_process

BINARY = shutil.which("prometheus-node-exporter")
NO_COLLECTORS = ("--collector.disable-defaults",)


def node_exporter_argv(port: int, flags: Sequence[str] = NO_COLLECTORS) -> list[str]:
    assert BINARY is not None, "prometheus-node-exporter is not installed (scripts/ensure-system-deps.sh)"
    return [BINARY, *flags, f"--web.listen-address=127.0.0.1:{port}"]


@contextmanager
def node_exporter(
    workdir: Path, timeout_s: float = 20.0, flags: Sequence[str] = NO_COLLECTORS
) -> Iterator[tuple[subprocess.Popen[bytes], tuple[str, int]]]:
    """Its process and address while the block runs."""
    address = ("127.0.0.1", free_port())
    with open(workdir / "node-exporter.log", "wb") as log:
        process = subprocess.Popen(node_exporter_argv(address[1], flags), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert process.poll() is None, (workdir / "node-exporter.log").read_text()
            try:
                socket.create_connection(address, timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "node_exporter did not start listening"
                time.sleep(0.05)
        yield process, address
    finally:
        stop_process(process)
