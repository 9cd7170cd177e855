"""A real HTTP server on 127.0.0.1 standing in for an engine's /metrics page, with fault modes for tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
VLLM_PAGE = FIXTURES / "vllm-0.32-metrics.txt"
OMNI_PAGE = FIXTURES / "vllm-omni-0.30-metrics.txt"
VLLM_MODEL = "kvx-tiny"  # the served model name in the recorded vLLM page
OMNI_MODEL = "/tmp/tinyq"  # ... and in the recorded vllm-omni page


def vllm_page_with(running: int, model_name: str = VLLM_MODEL) -> bytes:
    """The recorded real vLLM page, its running count and model name changed (everything else as recorded)."""
    text = VLLM_PAGE.read_text()
    old = f'vllm:num_requests_running{{engine="0",model_name="{VLLM_MODEL}"}} 0.0'
    assert old in text, "the recorded page changed: update this helper"
    text = text.replace(old, f'vllm:num_requests_running{{engine="0",model_name="{model_name}"}} {running}.0')
    return text.replace(f'model_name="{VLLM_MODEL}"', f'model_name="{model_name}"').encode()


@dataclass
class Behaviour:
    body: bytes = b""
    status: int = 200
    delay_s: float = 0.0  # before the status line
    trickle_s: float = 0.0  # between body chunks of `chunk` bytes
    chunk: int = 1024
    send_length: bool = True
    requests: int = 0
    authorization: list[str | None] = field(default_factory=list)


class _Handler(BaseHTTPRequestHandler):
    server: _EngineServer

    def do_GET(self) -> None:
        b = self.server.behaviour
        with self.server.lock:
            b.requests += 1
            b.authorization.append(self.headers.get("Authorization"))
        if b.delay_s:
            time.sleep(b.delay_s)
        try:
            self.send_response(b.status)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            if b.send_length:
                self.send_header("Content-Length", str(len(b.body)))
            self.end_headers()
            for start in range(0, len(b.body), b.chunk if b.trickle_s else max(1, len(b.body))):
                self.wfile.write(b.body[start : start + (b.chunk if b.trickle_s else len(b.body))])
                self.wfile.flush()
                if b.trickle_s:
                    time.sleep(b.trickle_s)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the exporter gave up on us, as it should

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _EngineServer(ThreadingHTTPServer):
    daemon_threads = True
    behaviour: Behaviour
    lock: threading.Lock


@dataclass
class FakeEngine:
    url: str
    behaviour: Behaviour


@contextmanager
def fake_engine(body: bytes = b"", **kwargs: Any) -> Iterator[FakeEngine]:
    server = _EngineServer(("127.0.0.1", 0), _Handler)
    server.behaviour = Behaviour(body=body, **kwargs)
    server.lock = threading.Lock()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield FakeEngine(f"http://127.0.0.1:{server.server_address[1]}/metrics", server.behaviour)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (bound, then closed)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/metrics"
