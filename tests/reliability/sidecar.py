"""The real sidecar as operators run it (`python -m kv_exporter serve`, a subprocess stopped by pid), and real
local HTTP servers on 127.0.0.1 standing in for engines, with the faults of issue 7 switchable while it runs."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kv_exporter.manifest import DeviceInfo, Manifest, ProcessInfo
from kv_exporter.reference import QWEN3_TTS, ReferenceModel
from tests.unit.fake_engine import vllm_page_with
from tests.unit.manifests import reference_manifest
from tests.unit.test_server import Samples, parse

REPO = Path(__file__).resolve().parent.parent.parent
# Root is not bound by permission bits: without these two capabilities it is, while still reaching its own checkout
# (which may sit in a 0700 folder no other user can enter).
DROP_FILE_CAPABILITIES = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
STOP_TIMEOUT_S = 15.0
_SERVING = re.compile(r"serving (http://127\.0\.0\.1:\d+)/metrics")
_counter = itertools.count()

Headers = dict[str, str]


@dataclass
class Sidecar:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def get(
        self, path: str = "/metrics", headers: Headers | None = None, timeout: float = 30.0
    ) -> tuple[int, Headers, bytes]:
        """One request on a fresh connection; any transport error propagates (the tests count it as a failure)."""
        conn = http.client.HTTPConnection(urllib.parse.urlsplit(self.url).netloc, timeout=timeout)
        try:
            conn.request("GET", path, headers=headers or {})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def samples(self, headers: Headers | None = None) -> Samples:
        status, _, body = self.get(headers=headers)
        assert status == 200, (status, body[:200])
        return parse(body.decode())

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Signal it, wait; a sidecar that does not stop in time is killed and the test fails."""
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(5)
            raise AssertionError(f"sidecar {self.process.pid} ignored signal {sig} for {timeout} s") from None


@contextmanager
def sidecar(workdir: Path, *args: str, permission_bits: bool = False, prelude: str = "") -> Iterator[Sidecar]:
    """Start `kv-exporter serve --listen-address 127.0.0.1:0 ARGS`, yield it once it serves, stop it by pid.

    Its output goes to a file (a pipe nobody reads would block a chatty sidecar). `permission_bits`: make file
    permissions apply to it when we are root (anyone else is bound by them already and runs it as is).
    `prelude`: Python run in the sidecar process before the command line is (e.g. to make a module unavailable).
    """
    log_path = workdir / f"sidecar-{next(_counter)}.log"
    entry = ["-m", "kv_exporter"]
    if prelude:
        entry = ["-c", f"{prelude}\nimport sys\nfrom kv_exporter.sidecar.cli import main\nsys.exit(main(sys.argv[1:]))"]
    command = [sys.executable, *entry, "serve", "--listen-address", "127.0.0.1:0", *args]
    if permission_bits and os.geteuid() == 0:
        command = [*DROP_FILE_CAPABILITIES, *command]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield Sidecar(process, _wait_for_url(process, log_path), log_path)
    finally:
        if process.poll() is None:
            Sidecar(process, "", log_path).stop()


def _wait_for_url(process: subprocess.Popen[bytes], log_path: Path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = _SERVING.search(log_path.read_text(errors="replace"))
        if match:
            return match.group(1)
        if process.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"sidecar did not start (exit {process.poll()}):\n{log_path.read_text(errors='replace')}")


# -- manifests -------------------------------------------------------------------------------------------------

MODEL = QWEN3_TTS.model_name  # the reference model most tests' manifests declare
SIMULATED_GPU = ("--simulate-gpu", "80GiB:60GiB")
SIMULATED_USED = 60 << 30


def live_manifest(model: ReferenceModel = QWEN3_TTS, process: ProcessInfo | None = None, **kwargs: Any) -> Manifest:
    """A reference manifest of a process that is alive (by default this test process, in this pid namespace: the
    sidecar checks it in /proc), on no recorded GPU, so that a lone simulated GPU stands in for it."""
    manifest = reference_manifest(model, **kwargs)
    return dataclasses.replace(manifest, process=process or ProcessInfo.current(), device=DeviceInfo(kind="cpu"))


def ceiling_bytes(manifest: Manifest) -> int:
    return sum(d.peak_bytes(manifest.max_num_seqs) for d in manifest.declarations)


def estimated_bytes(manifest: Manifest, running: int | None) -> int:
    """What the sidecar should estimate at `running` (None: engine unreadable, max_num_seqs rows fall back to 0)."""
    rows = 0 if running is None else min(running, manifest.max_num_seqs)
    return sum(d.bytes_per_row * d.rows_at(rows) for d in manifest.declarations)


# -- engines ---------------------------------------------------------------------------------------------------

HUGE_BYTES = 50 << 20
SLOW_S = 2.0  # the `slow` mode's pause before a good answer
HTML = b"<!doctype html><html><head><title>Sign in</title></head><body><form>...</form></body></html>\n"
JSON = b'{"status": "ok", "running": 3}\n'


class EngineHandler(BaseHTTPRequestHandler):
    """Answers as `server.mode` says: the engine faults of issue 7 (`refused` is the server not listening)."""

    server: SwitchableEngineServer
    protocol_version = "HTTP/1.0"  # close-delimited bodies are allowed, as the `huge_streamed` mode needs

    def do_GET(self) -> None:
        mode = self.server.mode
        with self.server.lock:
            self.server.requests += 1
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the sidecar gave up on us, as it should
            getattr(self, f"_{mode}")()

    def _head(self, status: int, length: int | None, content_type: str = "text/plain; version=0.0.4") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _ok(self) -> None:
        page = self.server.page
        self._head(200, len(page))
        self.wfile.write(page)

    def _hang(self) -> None:
        self.server.released.wait(60)  # past any sidecar timeout; released when the test ends

    def _slow(self) -> None:
        self.server.released.wait(SLOW_S)
        self._ok()

    def _status_500(self) -> None:
        body = b"Internal Server Error\n"
        self._head(500, len(body))
        self.wfile.write(body)

    def _truncated(self) -> None:
        page = self.server.page
        self._head(200, len(page))
        self.wfile.write(page[: len(page) // 2])  # the running-count line is in this half; then the close

    def _huge(self) -> None:
        self._head(200, HUGE_BYTES)
        self._stream(HUGE_BYTES)

    def _huge_streamed(self) -> None:
        self._head(200, None)  # no Content-Length: the sidecar must count what it reads
        self._stream(HUGE_BYTES)

    def _stream(self, total: int) -> None:
        block = (self.server.page * (1 + (1 << 20) // len(self.server.page)))[: 1 << 20]
        for _ in range(total // len(block)):
            self.wfile.write(block)

    def _html(self) -> None:
        self._head(200, len(HTML), "text/html; charset=utf-8")
        self.wfile.write(HTML)

    def _json(self) -> None:
        self._head(200, len(JSON), "application/json")
        self.wfile.write(JSON)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class SwitchableEngineServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # `restart` binds the same port again, as a restarted engine would

    def __init__(self, port: int, page: bytes) -> None:
        super().__init__(("127.0.0.1", port), EngineHandler)
        self.mode = "ok"
        self.page = page
        self.requests = 0
        self.lock = threading.Lock()
        self.released = threading.Event()


class SwitchableEngine:
    """An engine metrics page on 127.0.0.1 whose behaviour a test switches while the sidecar scrapes it."""

    def __init__(self, running: int = 17, model: str = MODEL) -> None:
        self.page = vllm_page_with(running, model)
        self._server: SwitchableEngineServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    @property
    def requests(self) -> int:
        return self._server.requests if self._server else 0

    def set(self, mode: str) -> None:
        """Switch fault mode; `refused` stops listening, any other mode listens again on the same port."""
        if mode == "refused":
            self.stop()
            return
        if self._server is None:
            self.start()
        assert self._server is not None and hasattr(EngineHandler, f"_{mode}"), mode
        if self._server.mode == "hang":  # let the hanging answers go (they end without a response)
            self._server.released.set()
            self._server.released = threading.Event()
        self._server.mode = mode

    def start(self) -> None:
        self._server = SwitchableEngineServer(self.port, self.page)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.released.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._server = None


@contextmanager
def switchable_engine(running: int = 17, model: str = MODEL) -> Iterator[SwitchableEngine]:
    engine = SwitchableEngine(running, model)
    try:
        yield engine
    finally:
        engine.stop()
