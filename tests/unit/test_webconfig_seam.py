"""The seam between the web config and the exporter's own server (kv_exporter.server), as `kv-exporter serve
--web.config.file` wires it: the webconfig mixins in front of ExporterServer / ExporterHandler, build_server without
its ssl_context (the mixin does TLS per connection, in the worker thread). A real TLS client scrapes the real
exporter with a client certificate and a password; wrong passwords, missing certificates and writes are refused."""

from __future__ import annotations

import base64
import http.client
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest

from kv_exporter.collector import Collection, Settings
from kv_exporter.manifest import write_manifest
from kv_exporter.server import ExporterApp, ExporterHandler, ExporterServer, build_server, serve_in_thread
from kv_exporter.webconfig import WebConfigHandlerMixin, WebConfigReloader, WebConfigServerMixin
from tests.unit.manifests import reference_manifest
from tests.unit.test_webconfig_pki import PKI, client_context, make_pki

PASSWORD = "scrape-me"
TIMEOUT_S = 20


class SecureExporterServer(WebConfigServerMixin, ExporterServer):
    pass


class SecureExporterHandler(WebConfigHandlerMixin, ExporterHandler):
    pass


@dataclass
class Exporter:
    server: ExporterServer
    port: int

    def request(
        self, context: ssl.SSLContext, password: str | None, method: str = "GET", path: str = "/metrics"
    ) -> tuple[int, dict[str, str], bytes]:
        headers = {}
        if password is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(f"prometheus:{password}".encode()).decode()
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=TIMEOUT_S, context=context)
        try:
            conn.request(method, path, headers=headers)
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def exporter(tmp_path: Path, pki: PKI) -> Iterator[Exporter]:
    manifests = tmp_path / "manifests"
    write_manifest(manifests, reference_manifest())
    config = tmp_path / "web.yml"
    config.write_text(
        "tls_server_config:\n"
        f"  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca.cert}\n"
        "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n"
        f"basic_auth_users:\n  prometheus: {bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()}\n"
    )
    reloader = WebConfigReloader(config)  # what `serve --web.config.file` does before it listens
    collection = Collection(Settings(manifest_dir=str(manifests)), None)
    server = build_server(
        "127.0.0.1:0",
        ExporterApp(collection),
        server_class=SecureExporterServer,
        handler_class=SecureExporterHandler,
    )
    server.web_config = reloader  # type: ignore[attr-defined]
    thread = serve_in_thread(server)
    try:
        yield Exporter(server, server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(TIMEOUT_S)
        collection.close()


def test_the_exporter_serves_its_metrics_over_mutual_tls_with_a_password(exporter: Exporter, pki: PKI) -> None:
    status, headers, body = exporter.request(client_context(pki, pki.client), PASSWORD)
    assert status == 200
    assert b"model_local_kv_manifests{" in body and b"model_local_kv_exporter_build_info{" in body
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_a_wrong_password_is_refused_by_the_exporter(exporter: Exporter, pki: PKI) -> None:
    for password in ("wrong", None):
        status, headers, body = exporter.request(client_context(pki, pki.client), password)
        assert status == 401 and headers["WWW-Authenticate"] == "Basic"
        assert b"model_local_kv" not in body


def test_the_exporter_refuses_a_client_without_a_certificate(exporter: Exporter, pki: PKI) -> None:
    with pytest.raises((ssl.SSLError, ConnectionResetError, http.client.RemoteDisconnected)):
        exporter.request(client_context(pki), PASSWORD)


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_the_exporter_accepts_no_writes(exporter: Exporter, pki: PKI, method: str) -> None:
    status, _, _ = exporter.request(client_context(pki, pki.client), PASSWORD, method=method)
    assert status in (405, 501)
