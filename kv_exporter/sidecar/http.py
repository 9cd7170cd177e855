"""The HTTP server: /metrics, /healthz and the landing page, with the exporter-toolkit web configuration
(`kv_exporter.web`) applied per connection (TLS) and per request (basic auth, headers) when one is given.
"""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from kv_exporter.sidecar.app import ExporterApp
from kv_exporter.web.tls import HANDSHAKE_TIMEOUT_S, accept_connection, close_quietly

if TYPE_CHECKING:  # the web extra (pyyaml, bcrypt) is needed only with --web.config.file
    from kv_exporter.web.config import WebConfig
    from kv_exporter.web.reload import WebConfigReloader

log = logging.getLogger(__name__)

DEFAULT_PORT = 9477  # 9400 is dcgm-exporter's
DEFAULT_LISTEN_ADDRESS = f":{DEFAULT_PORT}"
REQUEST_TIMEOUT_S = 30.0  # a client that stops sending cannot hold a thread for ever


class ExporterHandler(BaseHTTPRequestHandler):
    server: ExporterServer
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; with Nagle on, the body waits for the client's delayed ACK of the
    # headers on a keep-alive connection (~40 ms on Linux): docs/benchmarks.md, target 1.
    disable_nagle_algorithm = True
    timeout = REQUEST_TIMEOUT_S
    server_version = "kv-exporter"

    def authorize(self) -> bool:
        """True to serve the request; otherwise send the refusal and return False."""
        config = self.server.web_config_now()
        if config is None or config.check_auth(self.headers.get("Authorization")):
            return True
        self._send(401, b"Unauthorized\n", {"WWW-Authenticate": "Basic", "Content-Type": "text/plain; charset=utf-8"})
        return False

    def do_GET(self) -> None:
        with self.server.in_flight:  # a shutdown lets this answer finish (SIGTERM during a scrape)
            self._answer()

    do_HEAD = do_GET

    def _answer(self) -> None:
        if not self.authorize():
            return
        path = self.path.split("?", 1)[0]
        try:
            if path == self.server.app.telemetry_path:
                accept = self.headers.get("Accept"), self.headers.get("Accept-Encoding")
                body, headers = self.server.app.metrics(*accept)
                self._send(200, body, headers)
            elif path == "/healthz":
                self._send(200, b"ok\n", {"Content-Type": "text/plain; charset=utf-8"})
            elif path in ("/", "/index.html"):
                self._send(200, self.server.app.landing(), {"Content-Type": "text/html; charset=utf-8"})
            else:
                text = f"Not found: try {self.server.app.telemetry_path}\n".encode()
                self._send(404, text, {"Content-Type": "text/plain; charset=utf-8"})
        except Exception:  # the collector is built never to raise; if it does, answer rather than hang up
            log.exception("error serving %s", path)
            self._send(500, b"internal error, see the exporter log\n", {"Content-Type": "text/plain"})

    def end_headers(self) -> None:
        config = self.server.web_config_now()
        for name, value in (config.headers if config is not None else {}).items():
            self.send_header(name, value)  # the configured headers go on every answer, 401s included
        if self.server.in_flight.draining:  # shutting down: no further request on this connection
            self.send_header("Connection", "close")
        super().end_headers()

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


class InFlight:
    """Counts the requests being answered, so that a shutdown can wait for them."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()
        self.draining = False

    def __enter__(self) -> None:
        with self._changed:
            self._count += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._changed:
            self._count -= 1
            self._changed.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """From now on answers close their connection; wait until none is being written. False on timeout."""
        with self._changed:
            self.draining = True
            return self._changed.wait_for(lambda: self._count == 0, timeout_s)


class ExporterServer(ThreadingHTTPServer):
    # Handler threads are daemons, so an idle keep-alive connection never holds up the exit; `stop` waits for the
    # answers actually being written instead (a daemon thread killed mid-body would truncate a scrape).
    daemon_threads = True
    # socketserver's default backlog of 5 drops the SYNs of a burst of new connections, which then wait out the
    # 1 s retransmit: 32 scrapers connecting at once saw ~2 s first scrapes (docs/benchmarks.md, target 5).
    request_queue_size = 128
    app: ExporterApp
    web_config: WebConfigReloader | None = None
    handshake_timeout_s = HANDSHAKE_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight = InFlight()

    def web_config_now(self) -> WebConfig | None:
        return None if self.web_config is None else self.web_config.current()

    def finish_request(self, request: Any, client_address: Any) -> None:
        """With TLS configured, the handshake runs here: in the connection's own thread, with a timeout."""
        config = self.web_config_now()
        context = None if config is None else config.ssl_context()
        if config is None or context is None:
            super().finish_request(request, client_address)
            return
        conn = accept_connection(request, context, config.allowed_sans, self.handshake_timeout_s)
        if conn is None:
            return
        # The TLS socket took over the file descriptor: close it here, shutdown_request sees a detached socket.
        try:
            super().finish_request(conn, client_address)
        finally:
            close_quietly(conn)

    def stop(self, grace_s: float) -> bool:
        """Stop accepting, let the answers in progress finish (at most `grace_s`), close. False if some did not.

        Call from another thread than `serve_forever`'s.
        """
        self.shutdown()
        finished = self.in_flight.drain(grace_s)
        self.server_close()
        return finished


def parse_listen_address(text: str) -> tuple[str, int]:
    """`host:port`, `:port` (all interfaces) or `[v6]:port`."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address must be [host]:port, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host, int(port)


def build_server(listen_address: str, app: ExporterApp, web_config: WebConfigReloader | None = None) -> ExporterServer:
    host, port = parse_listen_address(listen_address)

    class Server(ExporterServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = Server((host or "0.0.0.0", port), ExporterHandler)
    server.app = app
    server.web_config = web_config
    return server


def serve_in_thread(server: ExporterServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="kv-exporter-http", daemon=True)
    thread.start()
    return thread


def server_url(server: ExporterServer) -> str:
    host, port = server.server_address[:2]
    shown = "localhost" if host in ("0.0.0.0", "::") else str(host)
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}"
