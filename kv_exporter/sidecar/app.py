"""The endpoints' content, independent of the HTTP plumbing: /metrics (text or OpenMetrics, gzip when asked) and
the landing page, both from one shared collection.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from kv_exporter.sidecar.collection import Collection, KVCollector, SingleFlight
from kv_exporter.sidecar.exposition import Exposition, Fixed
from kv_exporter.sidecar.gzipped import Gzip

# Level 1: a third of level 6's time on a 220 KB page, for a 20% larger body (docs/decisions/0003-gzip-level-1.md).
GZIP_LEVEL = 1
DEFAULT_TELEMETRY_PATH = "/metrics"
_MAX_SHARED_FORMATS = 16  # formats with a shared rendering; others (odd Accept headers) render per request

Encoder = Callable[[Collector], bytes]


def wants_gzip(accept_encoding: str | None) -> bool:
    """Whether `Accept-Encoding` (RFC 9110 12.5.3: tokens with q-values) takes gzip: `gzip` (or `x-gzip`) with a
    q-value above 0, or `*` above 0 when gzip is not named. A substring test gave gzip to `notgzip`."""
    named: dict[str, float] = {}
    for item in (accept_encoding or "").split(","):
        token, *params = (part.strip() for part in item.split(";"))
        named[token.lower()] = _quality(params)
    gzip_q = max((named[t] for t in ("gzip", "x-gzip") if t in named), default=None)
    return (gzip_q if gzip_q is not None else named.get("*", 0.0)) > 0


def _quality(params: list[str]) -> float:
    """The q parameter (1 when absent); a malformed one refuses the coding."""
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "q":
            try:
                q = float(value.strip())
            except ValueError:
                return 0.0
            return q if 0.0 <= q <= 1.0 else 0.0
    return 1.0


class ExporterApp:
    """The endpoints' content, independent of the HTTP plumbing."""

    def __init__(
        self, collection: Collection, telemetry_path: str = DEFAULT_TELEMETRY_PATH, exporter_metrics: bool = True
    ) -> None:
        self.collection = collection
        self.telemetry_path = telemetry_path
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(KVCollector(collection))
        # The exporter's own process, as every Python exporter reports it: process_*, python_info, python_gc_*;
        # left out by --web.disable-exporter-metrics, as node_exporter leaves out its process_*, go_*, promhttp_*.
        for own in (ProcessCollector, PlatformCollector, GCCollector) if exporter_metrics else ():
            own(registry=self.registry)
        self.exposition = Exposition()
        self._pages: dict[tuple[str, bool], SingleFlight[bytes]] = {}
        self._pages_lock = threading.Lock()

    def metrics(self, accept: str | None, accept_encoding: str | None) -> tuple[bytes, dict[str, str]]:
        encoder, content_type = choose_encoder(accept or "")
        compressed = wants_gzip(accept_encoding)
        body = self._page(encoder, content_type, compressed)()
        headers = {"Content-Type": content_type}
        if compressed:
            headers["Content-Encoding"] = "gzip"
        return body, headers

    def _page(self, encoder: Encoder, content_type: str, compressed: bool) -> Callable[[], bytes]:
        """Concurrent scrapes asking for the same format share one collection *and* one rendering: rendering per request
        made 32 concurrent scrapers wait for 32 renderings
        (docs/decisions/0005-shared-rendering-and-listen-backlog.md)."""
        key = (content_type, compressed)
        with self._pages_lock:
            flight = self._pages.get(key)
            if flight is None and len(self._pages) < _MAX_SHARED_FORMATS:  # the Accept header picks the key
                # bounded: the key comes from the Accept header; the followers' wait, by the collection deadline
                render = self._renderer(encoder, content_type, compressed)
                flight = self._pages[key] = SingleFlight(render, self.collection.settings.deadline_s)
        return flight or self._renderer(encoder, content_type, compressed)

    def _renderer(self, encoder: Encoder, content_type: str, compressed: bool) -> Callable[[], bytes]:
        # Made once per shared rendering, not per request: a Gzip holds a compressor (256 KiB of state to set up,
        # 1.2x the CPU a scrape at 32 scrapers when every request made one).
        gzip = Gzip(GZIP_LEVEL) if compressed else None  # its rendering runs one at a time

        def render() -> bytes:
            return self._render(encoder, content_type, gzip)

        return render

    def _render(self, encoder: Encoder, content_type: str, gzip: Gzip | None) -> bytes:
        metrics = list(self.registry.collect())
        chunks = self.exposition.chunks(metrics, content_type)
        if chunks is None:  # something the fast path does not cover: prometheus_client's own encoder
            chunks = [encoder(Fixed(metrics))]
        return b"".join(chunks) if gzip is None else gzip.page(chunks)  # a compressed page is never joined

    def landing(self) -> bytes:
        from kv_exporter.sidecar.landing import render_landing  # loaded when a person first asks, not at start-up

        return render_landing(self.collection.snapshot(), self.telemetry_path).encode()

    def trouble(self) -> str | None:
        """Why /healthz fails, or None. A collection stuck past its deadline fails every scrape until it returns,
        which only a restart may bring about."""
        overdue = self.collection.overdue_s()
        if not overdue:
            return None
        deadline = self.collection.settings.deadline_s
        return f"a collection has been running for {deadline + overdue:.0f} s, past its {deadline:g} s deadline"
