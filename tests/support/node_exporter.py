"""Debian's prometheus-node-exporter on 127.0.0.1, the reference for how an exporter-toolkit server answers: Go's
net/http behind the same toolkit the sidecar follows. Started with no collectors (only its own Go metrics), on a
free port, stopped by its pid. scripts/ensure-system-deps.sh installs it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.net import free_port
from tests.support.sidecar import stop_process

BINARY = shutil.which("prometheus-node-exporter")


@contextmanager
def node_exporter(workdir: Path, timeout_s: float = 20.0) -> Iterator[tuple[str, int]]:
    """Its address while the block runs."""
    assert BINARY is not None, "prometheus-node-exporter is not installed (scripts/ensure-system-deps.sh)"
    address = ("127.0.0.1", free_port())
    argv = [BINARY, "--collector.disable-defaults", f"--web.listen-address={address[0]}:{address[1]}"]
    with open(workdir / "node-exporter.log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
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
        yield address
    finally:
        stop_process(process)
