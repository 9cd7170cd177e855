"""The exporter in this process on a real socket: the collection, the app and the server as the CLI wires them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_exporter.gpu import GpuReader, SimulatedGpu
from kv_exporter.sidecar.app import ExporterApp
from kv_exporter.sidecar.collection import Collection, CollectionSettings
from kv_exporter.sidecar.engine_page import EngineTarget
from kv_exporter.sidecar.server import ExporterServer, build_server, serve_in_thread, server_url
from kv_exporter.transport.connection import Limits
from tests.support.constants import GPU_TOTAL, GPU_USED, OTHER_NS, UUID0
from tests.support.net import Headers, get
from tests.support.scrape import Samples, parse


def simulated_gpu(**overrides: Any) -> SimulatedGpu:
    """GPU 0 of the test manifests: 80 GiB, 60 GiB used."""
    return SimulatedGpu(**{"total": GPU_TOTAL, "used": GPU_USED, "uuid": UUID0, **overrides})


@dataclass
class Exporter:
    url: str
    server: ExporterServer
    collection: Collection

    def get(self, path: str = "/metrics", headers: Headers | None = None) -> tuple[int, Headers, bytes]:
        return get(self.url + path, headers, timeout=20)

    def text(self) -> str:
        status, _, body = self.get()
        assert status == 200, (status, body[:200])
        return body.decode()

    def samples(self) -> Samples:
        return parse(self.text())


@contextmanager
def exporter(
    manifest_dir: Path,
    urls: Sequence[str] = (),
    reader: GpuReader | None = None,
    *,
    our_namespace: str = OTHER_NS,
    limits: Limits = Limits(),  # noqa: B008  # frozen
    **settings: Any,
) -> Iterator[Exporter]:
    """Serve `manifest_dir` and the engine pages at `urls` on 127.0.0.1 (`settings`: CollectionSettings fields)."""
    targets = tuple(EngineTarget.parse(u) for u in urls)
    collection = Collection(CollectionSettings(str(manifest_dir), targets, **settings), reader, our_namespace)
    server = build_server("127.0.0.1:0", ExporterApp(collection), limits=limits)
    thread = serve_in_thread(server)
    try:
        yield Exporter(server_url(server), server, collection)
    finally:
        server.shutdown()
        server.server_close()
        collection.close()
        thread.join(5)
