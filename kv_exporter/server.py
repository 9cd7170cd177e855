"""HTTP endpoints: /metrics (text or OpenMetrics by Accept, gzip when asked), /healthz, and a landing page /.

Seam for TLS and basic auth: `build_server` takes an optional `ssl.SSLContext` (wraps the listening socket)
and an `authorize(authorization_header) -> bool` callable; the handler's `authorize()` and `end_headers()` are
the hooks `kv_exporter.webconfig.WebConfigHandlerMixin` overrides, and `server_class` / `handler_class` accept
the webconfig mixins in front of ours, so the exporter-toolkit `--web.config.file` plugs in without changes.
"""

from __future__ import annotations

import functools
import gzip
import logging
import re
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kv_exporter.collector import Collection, KVCollector, SingleFlight
from kv_exporter.families import GaugeRows
from kv_exporter.landing import render_landing

log = logging.getLogger(__name__)

DEFAULT_PORT = 9477  # 9400 is dcgm-exporter's
DEFAULT_LISTEN_ADDRESS = f":{DEFAULT_PORT}"
# Level 1: a third of level 6's time on a 220 KB page, for a 20% larger body (docs/benchmarks.md, target 1).
GZIP_LEVEL = 1
REQUEST_TIMEOUT_S = 30.0  # a client that stops sending cannot hold a thread for ever

Authorizer = Callable[[str | None], bool]
Encoder = Callable[[Collector], bytes]
_MAX_SHARED_FORMATS = 16  # formats with a shared rendering; others (odd Accept headers) render per request


class ExporterApp:
    """The endpoints' content, independent of the HTTP plumbing."""

    def __init__(self, collection: Collection) -> None:
        self.collection = collection
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(KVCollector(collection))
        self.exposition = Exposition()
        self._pages: dict[tuple[str, bool], SingleFlight[bytes]] = {}
        self._pages_lock = threading.Lock()

    def metrics(self, accept: str | None, accept_encoding: str | None) -> tuple[bytes, dict[str, str]]:
        encoder, content_type = choose_encoder(accept or "")
        compressed = "gzip" in (accept_encoding or "")
        body = self._page(encoder, content_type, compressed)()
        headers = {"Content-Type": content_type}
        if compressed:
            headers["Content-Encoding"] = "gzip"
        return body, headers

    def _page(self, encoder: Encoder, content_type: str, compressed: bool) -> Callable[[], bytes]:
        """Concurrent scrapes asking for the same format share one collection *and* one rendering: rendering
        per request made 32 concurrent scrapers wait for 32 renderings (docs/benchmarks.md, target 5)."""

        def render() -> bytes:
            return self._render(encoder, content_type, compressed)

        key = (content_type, compressed)
        with self._pages_lock:
            flight = self._pages.get(key)
            if flight is None and len(self._pages) < _MAX_SHARED_FORMATS:  # the Accept header picks the key
                flight = self._pages[key] = SingleFlight(render)
        return flight or render

    def _render(self, encoder: Encoder, content_type: str, compressed: bool) -> bytes:
        metrics = list(self.registry.collect())
        body = self.exposition.render(metrics, content_type)
        if body is None:  # something the fast path does not cover: prometheus_client's own encoder
            body = encoder(_Fixed(metrics))
        return gzip.compress(body, compresslevel=GZIP_LEVEL) if compressed else body

    def landing(self) -> bytes:
        return render_landing(self.collection.snapshot()).encode()


# -- exposition ------------------------------------------------------------------------------------------------

_LEGACY_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")  # unchanged by every escaping handled below
_SAME_FOR_LEGACY_NAMES = ("underscores", "allow-utf-8")  # escapings that leave such names as they are
_go_float: Callable[[float], str] = floatToGoString  # the value spelling both encoders use (untyped upstream)


class _Fixed(Collector):
    """Already-collected families, for prometheus_client's encoders."""

    def __init__(self, metrics: Sequence[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics


class Exposition:
    """prometheus_client's text and OpenMetrics output, byte for byte, for gauge and counter families with
    legacy names (all the exporter's own), at a fraction of the cost.

    prometheus_client validates and escapes every label of every sample on every scrape (~20 us a series
    here; 8 GPUs x 3 stages x 6 declarations took ~17 ms of a 21 ms scrape). Label sets and most values repeat
    from scrape to scrape, so their rendered text is kept while in use (what a page did not use is dropped),
    leaving dictionary lookups per series; `GaugeRows` families are read without building label dicts at all.
    `render` returns None for anything outside that path (other metric types, units, exemplars, timestamps,
    other escapings); the caller then uses prometheus_client's encoder.
    """

    def __init__(self) -> None:
        self._labels: _LabelTexts = {}
        self._values: dict[float, str] = {}

    def render(self, metrics: Iterable[Metric], content_type: str) -> bytes | None:
        if _escaping(content_type) not in _SAME_FOR_LEGACY_NAMES:
            return None
        page = _Page(content_type.startswith("application/openmetrics-text"), self._labels, self._values)
        if not all(page.family(metric) for metric in metrics):
            return None
        # Keep what this page used; concurrent renders at worst miss the cache.
        self._labels, self._values = page.labels, page.values
        return page.text()


_LabelTexts = dict[tuple[str, ...], dict[tuple[str, ...], str]]  # label names -> label values -> `{...}` text


class _Page:
    """One rendering: the lines so far, and the label and value texts it used (seeded from the last page's)."""

    def __init__(self, openmetrics: bool, labels: _LabelTexts, values: dict[float, str]) -> None:
        self.openmetrics = openmetrics
        self.previous_labels, self.previous_values = labels, values
        self.labels: _LabelTexts = {}
        self.values: dict[float, str] = {}
        self.out: list[str] = []

    def family(self, metric: Metric) -> bool:
        sample_name = {"gauge": metric.name, "counter": f"{metric.name}_total"}.get(metric.type)
        if sample_name is None or metric.unit or not _LEGACY_NAME.match(metric.name):
            return False
        self.out.append(_header(metric.name, metric.documentation, metric.type, self.openmetrics))
        if isinstance(metric, GaugeRows):
            return self.series(sample_name, metric.label_names, metric.rows)
        rows = []
        for sample in metric.samples:
            if sample.name != sample_name or sample.timestamp is not None or sample.exemplar is not None:
                return False
            if getattr(sample, "native_histogram", None) is not None:
                return False
            rows.append(((tuple(sample.labels), tuple(sample.labels.values())), sample.value))
        return all(self.series(sample_name, names, [(values, value)]) for (names, values), value in rows)

    def series(self, sample_name: str, names: tuple[str, ...], rows: Iterable[tuple[tuple[str, ...], float]]) -> bool:
        texts = self.labels.get(names)
        if texts is None:
            if not all(_LEGACY_NAME.match(name) for name in names) or len(set(names)) != len(names):
                return False
            texts = self.labels[names] = {}
        previous = self.previous_labels.get(names, {})
        out = self.out
        for values, value in rows:
            text = texts.get(values)
            if text is None:
                text = previous.get(values)
                texts[values] = text = _label_text(names, values) if text is None else text
            out.append(f"{sample_name}{text} {self.value_text(value)}\n")
        return True

    def value_text(self, value: float) -> str:
        if not value:  # 0.0 and -0.0 compare equal but print differently
            return _go_float(value)
        text = self.values.get(value) or self.previous_values.get(value) or _go_float(value)
        self.values[value] = text
        return text

    def text(self) -> bytes:
        return ("".join(self.out) + ("# EOF\n" if self.openmetrics else "")).encode()


def _escaping(content_type: str) -> str:
    """The name escaping choose_encoder picked (it says so in the content type when it is not the default)."""
    for part in content_type.split(";"):
        key, _, value = part.strip().partition("=")
        if key == "escaping":
            return value
    return "underscores"


@functools.lru_cache(maxsize=1024)
def _header(name: str, documentation: str, kind: str, openmetrics: bool) -> str:
    doc = documentation.replace("\\", r"\\").replace("\n", r"\n")
    if openmetrics:  # OpenMetrics escapes quotes in HELP too; the text format names counters with _total
        doc = doc.replace('"', r"\"")
    else:
        name = f"{name}_total" if kind == "counter" else name
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


def _label_text(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    """`{a="x",b="y"}` sorted by name (as prometheus_client prints them), values escaped."""
    if not names:
        return ""
    pairs = sorted(zip(names, values, strict=True))
    return "{" + ",".join(f'{name}="{_escape_value(value)}"' for name, value in pairs) + "}"


def _escape_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


# -- HTTP --------------------------------------------------------------------------------------------------------


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
        check = self.server.authorizer
        if check is None or check(self.headers.get("Authorization")):
            return True
        self._send(401, b"Unauthorized\n", {"WWW-Authenticate": "Basic", "Content-Type": "text/plain"})
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

    def end_headers(self) -> None:
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
    authorizer: Authorizer | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight = InFlight()

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
