"""The exporter-toolkit flags and endpoints node_exporter users type (issue 23, item 3), against the real
`kv-exporter serve`: each listen address served, systemd's sockets, no exporter metrics, the scrape limit, --version
on `serve`, a one-line error for a missing extra, and Prometheus' /-/healthy and /-/ready."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.support.constants import REPO, SIMULATE_GPU
from tests.support.net import free_port, get
from tests.support.pages import VLLM_PAGE
from tests.support.raw_http import exchange
from tests.support.scrape import parse
from tests.support.sidecar import ANNOUNCED_URL, ENTRY, run_command, sidecar, stop_process, with_prelude


def empty(tmp_path: Path) -> tuple[str, ...]:
    return ("--manifest-dir", str(tmp_path / "m"), *SIMULATE_GPU)


def test_every_listen_address_is_served(tmp_path: Path) -> None:
    """Today's main: the second --web.listen-address replaced the first."""
    second = free_port()
    with sidecar(tmp_path, *empty(tmp_path), "--web.listen-address", f"127.0.0.1:{second}") as sc:
        assert sc.get()[0] == 200
        assert get(f"http://127.0.0.1:{second}/metrics")[0] == 200
        assert f"127.0.0.1:{second}/metrics" in sc.log() and sc.url in sc.log()
        assert sc.stop() == 0


def test_the_sockets_systemd_passes_are_served(tmp_path: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    log_path = tmp_path / "systemd.log"
    # As systemd starts a socket-activated service: the socket at descriptor 3, LISTEN_PID the service's own pid.
    argv = ["sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh", sys.executable, *ENTRY, "serve", "--web.systemd-socket",
            *empty(tmp_path)]  # fmt: skip
    env = {**os.environ, "LISTEN_FDS": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(3,),
                                   preexec_fn=lambda: os.dup2(listener.fileno(), 3))  # fmt: skip
    listener.close()
    try:
        deadline = time.monotonic() + 30
        while not ANNOUNCED_URL.search(log_path.read_text()) and time.monotonic() < deadline:
            assert process.poll() is None, log_path.read_text()
            time.sleep(0.05)
        assert f"http://127.0.0.1:{port}/metrics" in log_path.read_text()
        assert get(f"http://127.0.0.1:{port}/metrics")[0] == 200
    finally:
        assert stop_process(process) == 0


def test_without_systemd_sockets_serve_says_so() -> None:
    done = run_command("serve", "--web.systemd-socket", "--no-nvml")
    assert done.returncode == 1
    assert b"no sockets passed by systemd" in done.stderr and b"Traceback" not in done.stderr


def test_exporter_metrics_can_be_left_out(tmp_path: Path) -> None:
    with sidecar(tmp_path, *empty(tmp_path)) as sc:
        names = {name for name, _ in parse(sc.text())}
        assert any(n.startswith("process_") for n in names) and any(n.startswith("python_") for n in names)
    with sidecar(tmp_path, *empty(tmp_path), "--web.disable-exporter-metrics") as sc:
        names = {name for name, _ in parse(sc.text())}
        assert not any(n.startswith(("process_", "python_")) for n in names), names
        assert "model_local_kv_manifests" in names
        assert sc.stop() == 0


def test_scrapes_past_max_requests_get_promhttp_s_503(tmp_path: Path) -> None:
    with SimulatedEngine(VLLM_PAGE.read_bytes(), fault="slow", delay_s=2.0) as engine:
        args = (*empty(tmp_path), "--engine-url", engine.url, "--web.max-requests", "1")
        with sidecar(tmp_path, *args) as sc:
            first: list[int] = []
            waiting = threading.Thread(target=lambda: first.append(sc.get(timeout=30)[0]))
            waiting.start()
            time.sleep(0.5)  # the first scrape waits on the slow engine
            status, _, body = sc.get(timeout=30)
            assert (status, body) == (503, b"Limit of concurrent requests reached (1), try again later.\n")
            assert sc.get("/healthz")[0] == 200  # only scrapes count
            waiting.join(30)
            assert first == [200]
            assert sc.get(timeout=30)[0] == 200  # a slot again
            assert sc.stop() == 0


@pytest.mark.parametrize("command", ["serve", "report", "demo"])
def test_every_command_takes_version(command: str) -> None:
    """`serve --version` was refused before issue 23; `report --version` and `demo --version` exited 2 before
    issue 41. Each prints the top-level line and exits 0 without doing its work (demo starts no engine)."""
    top, sub = run_command("--version"), run_command(command, "--version")
    assert top.returncode == sub.returncode == 0, sub.stderr
    assert sub.stdout == top.stdout and sub.stdout.startswith(b"kv-exporter") and sub.stdout.count(b"\n") == 1


def test_a_web_config_without_the_web_extra_is_one_line(tmp_path: Path) -> None:
    """Today's main: a traceback ending in ModuleNotFoundError."""
    config = tmp_path / "web.yml"
    config.write_text("")
    hide = "import sys\nsys.modules['yaml'] = None"
    argv = [sys.executable, *with_prelude(hide), "serve", "--web.config.file", str(config), *empty(tmp_path)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, timeout=60, check=False)
    assert done.returncode == 1
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and "'web' extra" in lines[0] and "kv-exporter[web]" in lines[0], lines


def test_prometheus_health_endpoints(tmp_path: Path) -> None:
    with sidecar(tmp_path, *empty(tmp_path)) as sc:
        assert sc.get("/-/healthy")[::2] == (200, b"kv-exporter is Healthy.\n")
        assert sc.get("/-/ready")[::2] == (200, b"kv-exporter is Ready.\n")
        host, port = urllib.parse.urlsplit(sc.url).hostname or "", sc.port
        head = b"HEAD /-/healthy HTTP/1.1\r\nHost: localhost\r\n\r\n"
        assert exchange((host, port), head).statuses == (200,)
        assert sc.stop() == 0
