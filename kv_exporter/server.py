"""HTTP endpoints: /metrics (text or OpenMetrics by Accept, gzip when asked), /healthz, and a landing page /.

Seam for TLS and basic auth: `build_server` takes an optional `ssl.SSLContext` (wraps the listening socket)
and an `authorize(authorization_header) -> bool` callable; the handler's `authorize()` and `end_headers()` are
the hooks `kv_exporter.webconfig.WebConfigHandlerMixin` overrides, and `server_class` / `handler_class` accept
the webconfig mixins in front of ours, so the exporter-toolkit `--web.config.file` plugs in without changes.
"""

from __future__ import annotations

import gzip
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kv_exporter.collector import Collection, KVCollector
from kv_exporter.landing import render_landing

log = logging.getLogger(__name__)

DEFAULT_PORT = 9477  # 9400 is dcgm-exporter's
DEFAULT_LISTEN_ADDRESS = f":{DEFAULT_PORT}"
REQUEST_TIMEOUT_S = 30.0  # a client that stops sending cannot hold a thread for ever

Authorizer = Callable[[str | None], bool]


class ExporterApp:
    """The endpoints' content, independent of the HTTP plumbing."""

    def __init__(self, collection: Collection) -> None:
        self.collection = collection
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(KVCollector(collection))

    def metrics(self, accept: str | None, accept_encoding: str | None) -> tuple[bytes, dict[str, str]]:
        encoder, content_type = choose_encoder(accept or "")
        body = encoder(self.registry)
        headers = {"Content-Type": content_type}
        if "gzip" in (accept_encoding or ""):
            body = gzip.compress(body, compresslevel=6)
            headers["Content-Encoding"] = "gzip"
        return body, headers

    def landing(self) -> bytes:
        return render_landing(self.collection.snapshot()).encode()


class ExporterHandler(BaseHTTPRequestHandler):
    server: ExporterServer
    protocol_version = "HTTP/1.1"
    timeout = REQUEST_TIMEOUT_S
    server_version = "kv-exporter"

    def authorize(self) -> bool:
        """True to serve the request; otherwise send the refusal and return False."""
        check = self.server.authorizer
        if check is None or check(self.headers.get("Authorization")):
            return True
        self._send(401, b"Unauthorized\n", {"WWW-Authenticate": "Basic", "Content-Type": "text/plain"})
        return False

    def do_GET(self) -> None:
        if not self.authorize():
            return
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                accept = self.headers.get("Accept"), self.headers.get("Accept-Encoding")
                body, headers = self.server.app.metrics(*accept)
                self._send(200, body, headers)
            elif path == "/healthz":
                self._send(200, b"ok\n", {"Content-Type": "text/plain; charset=utf-8"})
            elif path in ("/", "/index.html"):
                self._send(200, self.server.app.landing(), {"Content-Type": "text/html; charset=utf-8"})
            else:
                self._send(404, b"Not found: try /metrics\n", {"Content-Type": "text/plain; charset=utf-8"})
        except Exception:  # the collector is built never to raise; if it does, answer rather than hang up
            log.exception("error serving %s", path)
            self._send(500, b"internal error, see the exporter log\n", {"Content-Type": "text/plain"})

    do_HEAD = do_GET

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class ExporterServer(ThreadingHTTPServer):
    daemon_threads = True
    app: ExporterApp
    authorizer: Authorizer | None = None


def parse_listen_address(text: str) -> tuple[str, int]:
    """`host:port`, `:port` (all interfaces) or `[v6]:port`."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address must be [host]:port, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host, int(port)


def build_server(
    listen_address: str,
    app: ExporterApp,
    *,
    ssl_context: ssl.SSLContext | None = None,
    authorize: Authorizer | None = None,
    server_class: type[ExporterServer] = ExporterServer,
    handler_class: type[ExporterHandler] = ExporterHandler,
) -> ExporterServer:
    host, port = parse_listen_address(listen_address)

    class Server(server_class):  # type: ignore[valid-type, misc]
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server: ExporterServer = Server((host or _any_address(), port), handler_class)
    server.app = app
    server.authorizer = authorize
    if ssl_context is not None:
        server.socket = ssl_context.wrap_socket(server.socket, server_side=True)
    return server


def _any_address() -> str:
    return "0.0.0.0"


def serve_in_thread(server: ExporterServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="kv-exporter-http", daemon=True)
    thread.start()
    return thread


def server_url(server: ExporterServer) -> str:
    host, port = server.server_address[:2]
    shown = "localhost" if host in ("0.0.0.0", "::") else str(host)
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}"
