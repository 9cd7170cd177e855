"""The HTTP server: /metrics, /healthz and the landing page, with the exporter-toolkit web configuration
(`kv_exporter.web`) applied per connection (TLS) and per request (basic auth, headers) when one is given.

The transport (`kv_exporter.transport.server`: an asyncio loop in one thread holding every connection, TLS, request
heads read as Go reads them, deadlines, the connection cap) hands each complete request here; up to `MAX_WORKERS`
threads answer them. Authentication comes first, then the method, then the path, as behind the toolkit's middleware.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING

from kv_exporter.sidecar.app import ExporterApp
from kv_exporter.sidecar.collection import FlightTimeout
from kv_exporter.transport.connection import TLS, Limits, Reply
from kv_exporter.transport.request_head import Request
from kv_exporter.transport.server import Server
from kv_exporter.transport.workers import Workers

if TYPE_CHECKING:  # the web extra (pyyaml, bcrypt) is needed only with --web.config.file
    from kv_exporter.web.config import WebConfig
    from kv_exporter.web.reload import WebConfigReloader

log = logging.getLogger(__name__)

DEFAULT_PORT = 9477  # 9400 is dcgm-exporter's
DEFAULT_LISTEN_ADDRESS = f":{DEFAULT_PORT}"
DEMO_LISTEN_ADDRESS = "127.0.0.1:9477"  # the demo's: loopback only
# Requests answered at once; workers start as requests need them. Scrapes answered at once share one collection
# and one rendering: with 8 workers, 50 scrapers made 4x the collections and 30% fewer scrapes a second than with
# as many workers as scrapers. A worker waiting on a stuck collection is freed at the collection deadline; the one
# running it stays with it (its request is answered 503 at the deadline all the same).
MAX_WORKERS = 64
# The kernel's queue of connections not yet accepted. With 5 (socketserver's default), a burst of new connections
# lost SYNs and waited out the 1 s retransmit: 32 scrapers connecting at once saw ~2 s first scrapes
# (docs/decisions/0005-shared-rendering-and-listen-backlog.md).
LISTEN_BACKLOG = 128
# Requests whose credential is not cached yet (a bcrypt check) are answered by a thread of their own: bcrypt runs one
# at a time (web/auth.py), and 200 clients with wrong passwords once held every worker waiting for it, so that a
# verified scraper and /healthz waited 5-10 s.
PASSWORD_CHECK_WORKERS = 1
_TEXT = "text/plain; charset=utf-8"
HEALTH_ANSWERS = {"/-/healthy": b"kv-exporter is Healthy.\n", "/-/ready": b"kv-exporter is Ready.\n"}
_INTERNAL_ERROR_TEXT = b"internal error, see the exporter log\n"
_INTERNAL_ERROR = b"HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (
    len(_INTERNAL_ERROR_TEXT),
    _INTERNAL_ERROR_TEXT,
)


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=lambda: {"Content-Type": _TEXT})


class ExporterServer:
    """Serves `app` on `listeners` (one or more, as node_exporter listens on each --web.listen-address):
    `serve_forever` in one thread, `stop` (or `shutdown`, `server_close`) in another."""

    def __init__(
        self,
        listeners: socket.socket | Sequence[socket.socket],
        app: ExporterApp,
        web_config: WebConfigReloader | None = None,
        limits: Limits = Limits(),  # noqa: B008  # frozen: one shared default is safe
    ) -> None:
        listeners = [listeners] if isinstance(listeners, socket.socket) else list(listeners)
        self.app = app
        self.web_config = web_config
        self.server_addresses: list[tuple[str, int]] = [listener.getsockname()[:2] for listener in listeners]
        self.server_address = self.server_addresses[0]
        self._workers = Workers(MAX_WORKERS, "kv-exporter")
        self._password_workers = Workers(PASSWORD_CHECK_WORKERS, "kv-exporter-password")
        self._server = Server(listeners, self._submit, self._tls, limits)
        self._max_requests = limits.max_requests
        self._scrape_slots = threading.BoundedSemaphore(limits.max_requests) if limits.max_requests else None
        self._answer_deadline_s = app.collection.settings.deadline_s

    def web_config_now(self, wait_s: float | None = None) -> WebConfig | None:
        if self.web_config is None:
            return None
        return self.web_config.current() if wait_s is None else self.web_config.current(wait_s)

    def serve_forever(self) -> None:
        try:
            self._server.serve_forever()
        finally:
            self._workers.close()
            self._password_workers.close()

    def shutdown(self) -> None:
        """Stop `serve_forever`, closing every connection at once."""
        self._server.stop()

    def server_close(self) -> None:
        self._server.close()

    def stop(self, grace_s: float) -> bool:
        """Stop accepting, let the answers in progress finish (at most `grace_s`), close. False if some did not.

        Answers finished meanwhile carry `Connection: close`; idle keep-alive connections are closed at once.
        """
        finished = self._server.drain(grace_s)
        self._server.stop()
        self._server.close()
        return finished

    def _tls(self) -> TLS | None:
        """Per new connection: a reloaded config (a rotated certificate) applies from the next one on. Called on
        the server's loop, which never waits for a check of the files."""
        config = self.web_config_now(wait_s=0)
        context = None if config is None else config.ssl_context()
        return None if config is None or context is None else (context, config.allowed_sans)

    def _submit(self, request: Request) -> asyncio.Future[Reply]:
        """On the server's loop: the answer to `request`, from a worker thread, or a 503 at the collection deadline
        when the worker has none by then (as Go's http.TimeoutHandler answers): the worker that met a stuck collection
        first is the one running it (`SingleFlight`), and stays with it."""
        workers = self._password_workers if self._needs_password_check(request) else self._workers
        answer = workers.submit(self._serve_safely, request)

        def late() -> None:  # the worker's own answer, if it ever comes, is then dropped (`Workers` skips it)
            if not answer.done():
                text = self.app.trouble() or f"no answer within {self._answer_deadline_s:g} s"
                config = self.web_config_now(wait_s=0)
                headers = config.headers if config is not None else {}
                answer.set_result((encode(request, Answer(503, f"{text}\n".encode()), headers, True), True))

        timer = answer.get_loop().call_later(self._answer_deadline_s, late)
        answer.add_done_callback(lambda _: timer.cancel())
        return answer

    def _needs_password_check(self, request: Request) -> bool:
        """On the server's loop: whether answering would run bcrypt (never waiting for a web config check)."""
        config = self.web_config_now(wait_s=0)
        return config is not None and config.known_auth(request.header("Authorization")) is None

    def _serve_safely(self, request: Request) -> Reply:
        try:
            return self._serve(request)
        except Exception:  # a connection left without an answer would wait for ever
            log.exception("error answering %s", request.path)
            return (_INTERNAL_ERROR,), True

    def _serve(self, request: Request) -> Reply:
        config = self.web_config_now()
        answer = self._answer(request, config)
        headers = {**answer.headers, **(config.headers if config is not None else {})}  # 401s included
        close = request.close or self._server.draining  # shutting down: no further request on this connection
        return encode(request, answer, headers, close), close

    def _answer(self, request: Request, config: WebConfig | None) -> Answer:
        try:
            if config is not None and not config.check_auth(request.header("Authorization")):
                return Answer(401, b"Unauthorized\n", {"WWW-Authenticate": "Basic", "Content-Type": _TEXT})
            if request.method not in ("GET", "HEAD"):
                return Answer(405, b"Method Not Allowed: nothing here takes a write\n",
                              {"Allow": "GET, HEAD", "Content-Type": _TEXT})  # fmt: skip
            return self._route(request.path, request)
        except FlightTimeout as exc:
            return Answer(503, f"{exc}\n".encode())
        except Exception:  # the collector is built never to raise; if it does, answer rather than hang up
            log.exception("error serving %s", request.path)
            return Answer(500, _INTERNAL_ERROR_TEXT)

    def _route(self, path: str, request: Request) -> Answer:
        app = self.app
        if path == app.telemetry_path:
            slots = self._scrape_slots
            if slots is not None and not slots.acquire(blocking=False):
                text = f"Limit of concurrent requests reached ({self._max_requests}), try again later.\n"
                return Answer(503, text.encode())  # promhttp's answer past --web.max-requests
            try:
                body, headers = app.metrics(request.header("Accept"), request.header("Accept-Encoding"))
            finally:
                if slots is not None:
                    slots.release()
            return Answer(200, body, headers)
        if path in HEALTH_ANSWERS:  # Prometheus' own: the process serves (and, being up, is ready)
            return Answer(200, HEALTH_ANSWERS[path])
        if path == "/healthz":
            trouble = app.trouble()
            return Answer(503, f"unhealthy: {trouble}\n".encode()) if trouble else Answer(200, b"ok\n")
        if path in ("/", "/index.html"):
            return Answer(200, app.landing(), {"Content-Type": "text/html; charset=utf-8"})
        return Answer(404, f"Not found: try {app.telemetry_path}\n".encode())


def encode(request: Request, answer: Answer, headers: Mapping[str, str], close: bool) -> tuple[bytes, ...]:
    """The answer on the wire: the head, then the body (not copied: concurrent scrapes share one)."""
    version = "HTTP/1.0" if request.version == (1, 0) else "HTTP/1.1"
    lines = [
        f"{version} {answer.status} {HTTPStatus(answer.status).phrase}",
        f"Date: {formatdate(usegmt=True)}",
        *(f"{name}: {value}" for name, value in headers.items()),
        f"Content-Length: {len(answer.body)}",
    ]
    if close:
        lines.append("Connection: close")
    elif request.version == (1, 0):
        lines.append("Connection: keep-alive")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()  # configured header values as UTF-8, as Go sends them
    return (head,) if request.method == "HEAD" else (head, answer.body)


def parse_listen_address(text: str) -> tuple[str, int]:
    """`host:port`, `:port` (all interfaces) or `[v6]:port`."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address must be [host]:port, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host, int(port)


def listen(listen_address: str) -> socket.socket:
    host, port = parse_listen_address(listen_address)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        listener.bind((host or "0.0.0.0", port))
        listener.listen(LISTEN_BACKLOG)
    except OSError:
        listener.close()
        raise
    return listener


SYSTEMD_FIRST_FD = 3  # sd_listen_fds(3): the passed sockets start at SD_LISTEN_FDS_START


def systemd_sockets(environ: Mapping[str, str] | None = None) -> list[socket.socket]:
    """The listening sockets systemd passed (socket activation: LISTEN_PID, LISTEN_FDS), as
    `--web.systemd-socket` takes them; ValueError when there are none for this process."""
    env = os.environ if environ is None else environ
    if env.get("LISTEN_PID") != str(os.getpid()) or not env.get("LISTEN_FDS", "").isdigit():
        raise ValueError("no sockets passed by systemd (LISTEN_PID, LISTEN_FDS) to this process")
    count = int(env["LISTEN_FDS"])
    if count < 1:
        raise ValueError("systemd passed no sockets (LISTEN_FDS=0)")
    return [socket.socket(fileno=fd) for fd in range(SYSTEMD_FIRST_FD, SYSTEMD_FIRST_FD + count)]


def build_server(
    listen_address: str | Sequence[str] | Sequence[socket.socket],
    app: ExporterApp,
    web_config: WebConfigReloader | None = None,
    limits: Limits = Limits(),  # noqa: B008
) -> ExporterServer:
    """A server on each address (or on the given listening sockets: systemd's)."""
    wanted: list[str | socket.socket] = [listen_address] if isinstance(listen_address, str) else [*listen_address]
    listeners: list[socket.socket] = []
    try:
        for item in wanted:
            listeners.append(item if isinstance(item, socket.socket) else listen(item))
    except OSError:
        for listener in listeners:
            listener.close()
        raise
    return ExporterServer(listeners, app, web_config, limits)


def serve_in_thread(server: ExporterServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="kv-exporter-http", daemon=True)
    thread.start()
    return thread


def server_urls(server: ExporterServer) -> list[str]:
    return [_url(address) for address in server.server_addresses]


def server_url(server: ExporterServer) -> str:
    return _url(server.server_address)


def _url(address: tuple[str, int]) -> str:
    host, port = address
    shown = "localhost" if host in ("0.0.0.0", "::") else str(host)
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}"
