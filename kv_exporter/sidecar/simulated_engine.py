"""A simulated engine: a real HTTP server on 127.0.0.1 serving vLLM-format metrics pages, one per path.

It is `kv-exporter demo`'s backend, and the stand-in engine that the tests and the benchmarks scrape. A page is
bytes, or a function that builds them on every request. The engine answers as its `fault` says, switchable while it
runs: the ways an engine's page goes wrong (docs/reliability.md), each one a reason the sidecar counts. It counts the
requests it gets, keeps the Authorization header of the last one, keeps a connection open for the next request after
an `ok` answer to HTTP/1.1 (closing it after KEEP_ALIVE_S idle, or when it stops), and stops and listens again on the
same port, as a restarted engine does. Standard library only, like the rest of the sidecar.
"""

from __future__ import annotations

import contextlib
import http
import socket
import socketserver
import threading
from collections.abc import Callable, Mapping
from io import BufferedIOBase

Page = bytes | Callable[[], bytes]

METRICS_PATH = "/metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# What each fault sends (`refused` is not an answer: nothing listens on the port).
FAULTS = (
    "ok",
    "slow",  # the page, after `delay_s`
    "hang",  # reads the request, never answers
    "trickle",  # the page in TRICKLE_CHUNK-byte pieces, TRICKLE_S apart
    "status_500",
    "truncated",  # closes half-way through its Content-Length
    "no_length",  # the page without Content-Length: only the close ends it
    "huge",  # HUGE_BYTES, announced in Content-Length
    "huge_streamed",  # HUGE_BYTES, close-delimited: only counting tells
    "html",  # a login page where the metrics should be
    "json",
    # HTTP framing, each a way a server can hold a client that gives every read its own timeout:
    "trickle_status",  # the status line a byte at a time, never finished
    "trickle_headers",  # a header line every TRICKLE_S, never the end of them
    "interim",  # `100 Continue` answers every INTERIM_S, never the real one
    "interim_flood",  # `100 Continue` answers as fast as they go (Go's client stops after 5)
    "trickle_chunked",  # a chunked body whose chunk-size line grows a byte at a time (an extension)
    # HTTP framing Go's client takes, or refuses:
    "early_hints",  # two `103 Early Hints` answers, then the page
    "chunked",  # the page in chunks, with a chunk extension and a trailer
    "bad_chunk",  # a chunk size that is not hexadecimal
    "two_lengths",  # two Content-Length headers that disagree
)
REFUSED = "refused"
SLOW_S = 2.0
HANG_S = 60.0  # past any sidecar timeout; cut short when the fault changes or the engine stops
TRICKLE_CHUNK, TRICKLE_S = 1000, 0.12  # vLLM's 51 KB page takes ~6 s
INTERIM_S = 0.3  # 5 interim answers take longer than a 1 s engine timeout
HUGE_BYTES = 50 << 20
HTML = b"<!doctype html><html><head><title>Sign in</title></head><body><form>...</form></body></html>\n"
JSON = b'{"status": "ok", "running": 3}\n'
_MAX_LINE = 1 << 16
KEEP_ALIVE_S = 5.0  # an idle connection is closed after this, as uvicorn's (vLLM's server's) default does


def vllm_page(model_name: str, running: int) -> bytes:
    """A vLLM-format page (the series names and labels vLLM 0.32 prints) for one engine serving `model_name`."""
    name = model_name.replace("\\", "\\\\").replace('"', '\\"')
    labels = f'engine="0",model_name="{name}"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {float(running)}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
    ).encode()


class SimulatedEngine:
    """Listens on 127.0.0.1:`port` (0: any free port) from construction until `stop()`; a context manager."""

    def __init__(self, pages: Page | Mapping[str, Page], *, fault: str = "ok", delay_s: float = SLOW_S, port: int = 0):
        self.pages: dict[str, Page] = dict(pages) if isinstance(pages, Mapping) else {METRICS_PATH: pages}
        self.delay_s = delay_s
        self.port = port
        self.requests = 0
        self.connections = 0  # accepted: fewer than requests when clients keep them open
        self.authorization: str | None = None  # of the last request
        self._fault = "ok"
        self._released = threading.Event()  # set to cut short the waits of `hang`, `slow` and `trickle`
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.set(fault)

    @property
    def url(self) -> str:
        """The URL of the first page."""
        return self.url_for(next(iter(self.pages)))

    def url_for(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def open_connections(self) -> int:
        """Connections open now (kept by clients, not yet closed for idling or by `stop`)."""
        return 0 if self._server is None else len(self._server.connections)

    @property
    def fault(self) -> str:
        return self._fault if self._server is not None else REFUSED

    def set(self, fault: str) -> None:
        """Answer as `fault` says from the next request on; `refused` stops listening, any other fault listens
        again (on the same port) if it had stopped."""
        if fault == REFUSED:
            self.stop()
            return
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}: one of {', '.join(FAULTS)} or {REFUSED}")
        if self._server is None:
            self._listen()
        with self._lock:
            if self._fault == "hang":  # the hanging answers end now (without a response)
                self._release()
            self._fault = fault

    def stop(self) -> None:
        if self._server is None:
            return
        with self._lock:
            self._release()
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()
        if self._thread is not None:
            self._thread.join(5)
        self._server = self._thread = None

    def __enter__(self) -> SimulatedEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _listen(self) -> None:
        self._server = _Server(("127.0.0.1", self.port), _Handler)
        self._server.engine = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="simulated-engine", daemon=True)
        self._thread.start()

    def _release(self) -> None:
        self._released.set()
        self._released = threading.Event()

    def connected(self) -> None:
        with self._lock:
            self.connections += 1

    def _serve(self, out: BufferedIOBase, path: str, authorization: str | None, keep_alive: bool) -> bool:
        """Answer one request; whether the connection stays open (only an `ok` answer to a client keeping it)."""
        with self._lock:
            self.requests += 1
            self.authorization = authorization
            fault, released = self._fault, self._released
        source = self.pages.get(path)
        if source is None:
            out.write(_response(404, b"no such page\n"))
            return False
        page = source() if callable(source) else source
        if fault == "ok" and keep_alive:
            out.write(b"%sContent-Length: %d\r\n\r\n%s" % (_OK_11, len(page), page))
            return True
        if fault == "hang":
            released.wait(HANG_S)
        elif fault in _ENDLESS:
            _ENDLESS[fault](out, released)
        elif fault == "trickle":
            out.write(_head(200, len(page)))
            for start in range(0, len(page), TRICKLE_CHUNK):
                out.write(page[start : start + TRICKLE_CHUNK])
                if released.wait(TRICKLE_S):
                    return False
        elif fault in ("huge", "huge_streamed"):
            out.write(_head(200, HUGE_BYTES if fault == "huge" else None))
            block = (page * (1 + (1 << 20) // len(page)))[: 1 << 20]
            for _ in range(HUGE_BYTES // len(block)):
                out.write(block)
        else:
            if fault == "slow":
                released.wait(self.delay_s)
            out.write(_whole_answer(fault, page))
        return False


def _endless(first: bytes, repeated: bytes, pause_s: float) -> Callable[[BufferedIOBase, threading.Event], None]:
    """An answer that sends `first`, then `repeated` every `pause_s` until released (the fault changes)."""

    def send(out: BufferedIOBase, released: threading.Event) -> None:
        out.write(first)
        out.flush()
        while not released.wait(pause_s):
            out.write(repeated)
            out.flush()

    return send


_OK_11 = b"HTTP/1.1 200 OK\r\nContent-Type: " + CONTENT_TYPE.encode() + b"\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_ENDLESS = {
    "trickle_status": _endless(b"H", b"T", TRICKLE_S),
    "trickle_headers": _endless(_OK_11, b"X-Trickle: 1\r\n", TRICKLE_S),
    "interim": _endless(_CONTINUE, _CONTINUE, INTERIM_S),
    "trickle_chunked": _endless(_OK_11 + b"Transfer-Encoding: chunked\r\n\r\n10;x", b"x", TRICKLE_S),
}
# Answered on a thread of their own.
WAITING = frozenset({"slow", "hang", "trickle", "huge", "huge_streamed", *_ENDLESS})


def _chunked(page: bytes) -> bytes:
    """`page` as an HTTP/1.1 chunked body in 4 KiB chunks, each with an extension, and a trailer."""
    chunks = [page[i : i + 4096] for i in range(0, len(page), 4096)]
    body = b"".join(b"%x;name=value\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks)
    return _OK_11 + b"Transfer-Encoding: chunked\r\n\r\n" + body + b"0\r\nX-Trailer: done\r\n\r\n"


def _whole_answer(fault: str, page: bytes) -> bytes:
    """Status line, head and body of a fault that answers in one write."""
    if fault == "status_500":
        return _response(500, b"Internal Server Error\n")
    if fault == "truncated":  # the running-count line is in the half that is sent
        return _head(200, len(page)) + page[: len(page) // 2]
    if fault == "no_length":
        return _head(200, None) + page
    if fault == "html":
        return _response(200, HTML, "text/html; charset=utf-8")
    if fault == "json":
        return _response(200, JSON, "application/json")
    if fault == "interim_flood":
        return _CONTINUE * 10_000
    if fault == "early_hints":
        return b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n" * 2 + _response(200, page)
    if fault == "chunked":
        return _chunked(page)
    if fault == "bad_chunk":
        return _OK_11 + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + page + b"\r\n0\r\n\r\n"
    if fault == "two_lengths":
        return _head(200, len(page))[:-2] + b"Content-Length: %d\r\n\r\n" % (len(page) // 2) + page
    return _response(200, page)  # ok, slow


def _response(status: int, body: bytes, content_type: str = CONTENT_TYPE) -> bytes:
    return _head(status, len(body), content_type) + body


def _head(status: int, length: int | None, content_type: str = CONTENT_TYPE) -> bytes:
    """HTTP/1.0, so that a body without Content-Length is allowed (the connection's close ends it)."""
    lines = [f"HTTP/1.0 {status} {http.HTTPStatus(status).phrase}", f"Content-Type: {content_type}"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class _Handler(socketserver.StreamRequestHandler):
    """Reads only the request line, the Authorization header and the Connection header: cheaper than http.server's
    parsing, so that what a benchmark times is the sidecar, not the stand-in. Serves the requests of one connection
    until an answer ends it or the connection idles KEEP_ALIVE_S."""

    server: _Server
    disable_nagle_algorithm = True

    def handle(self) -> None:
        self.server.engine.connected()
        self.server.connections.add(self.connection)
        try:
            while self._one_request():
                self.connection.settimeout(KEEP_ALIVE_S)
        except (TimeoutError, OSError):  # idle past KEEP_ALIVE_S, or closed by the client or by `stop`
            pass
        finally:
            self.server.connections.discard(self.connection)

    def _one_request(self) -> bool:
        """Answer one request; whether the connection stays open for another."""
        words = self.rfile.readline(_MAX_LINE).split()
        if not words:
            return False  # the client closed the connection
        authorization = None
        keep = words[-1] == b"HTTP/1.1"
        while (line := self.rfile.readline(_MAX_LINE)).strip():
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"authorization":
                authorization = value.strip().decode("latin-1")
            elif name == b"connection" and b"close" in value.lower():
                keep = False
        path = words[1].split(b"?", 1)[0].decode("latin-1") if len(words) > 1 else ""
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the reader gave up on us, as it may
            return self.server.engine._serve(self.wfile, path, authorization, keep)
        return False


class _Server(socketserver.ThreadingTCPServer):
    """A thread per connection (uvicorn, vLLM's server, serves connections concurrently too)."""

    daemon_threads = True
    allow_reuse_address = True  # listening again on the same port, as a restarted engine does
    request_queue_size = 64
    engine: SimulatedEngine

    def __init__(self, address: tuple[str, int], handler: type[_Handler]) -> None:
        super().__init__(address, handler)
        self.connections: set[socket.socket] = set()  # open ones, closed by `stop` as a stopping server does

    def close_connections(self) -> None:
        for connection in list(self.connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
