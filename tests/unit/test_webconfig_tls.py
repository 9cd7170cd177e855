"""The web config on a real socket, as `kv-exporter serve --web.config.file` wires it: the exporter's own server
(`kv_exporter.sidecar.server.build_server` with a `WebConfigReloader`), scraped by TLS clients (Python's ssl and curl).
Right and wrong passwords, missing and foreign client certificates, plain HTTP to the TLS port, TLS to the plain port,
version and cipher limits, live reloads, and a stalled client that must not block others."""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import bcrypt
import pytest

from kv_exporter.manifest import write_manifest
from kv_exporter.sidecar.app import ExporterApp
from kv_exporter.sidecar.collection import Collection, CollectionSettings
from kv_exporter.sidecar.server import ExporterServer, build_server, serve_in_thread
from kv_exporter.transport.connection import PLAIN_HTTP_TO_TLS_RESPONSE, Limits
from kv_exporter.web.reload import WebConfigReloader
from tests.support import net
from tests.support.manifests import reference_manifest
from tests.support.pki import PKI, Issued, client_context, make_pki
from tests.support.raw_http import Answers

PASSWORD = "correct horse"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
METRICS = b"model_local_kv_exporter_build_info{"  # on every page the exporter serves
TIMEOUT_S = 10


class Running:
    def __init__(self, server: ExporterServer, collection: Collection) -> None:
        self.server = server
        self.collection = collection
        self.thread = serve_in_thread(server)
        self.host, self.port = "127.0.0.1", int(server.server_address[1])

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(TIMEOUT_S)
        self.collection.close()


Serve = Callable[[str], Running]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    running: list[Running] = []
    manifests = tmp_path / "manifests"
    write_manifest(manifests, reference_manifest())

    def start(text: str) -> Running:
        path = tmp_path / "web.yml"
        path.write_text(text)
        reloader = WebConfigReloader(path, interval=0.0)  # re-check on every request: reload tests stay fast
        collection = Collection(CollectionSettings(manifest_dir=str(manifests)), None)
        server = build_server("127.0.0.1:0", ExporterApp(collection), reloader, Limits(handshake_timeout_s=3.0))
        running.append(Running(server, collection))
        return running[-1]

    yield start
    for item in running:
        item.stop()


REQUIRE_CLIENT_CERT = "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {ca}\n"


def tls_config(pki: PKI, extra: str = "") -> str:
    return f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n{extra}"


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": net.basic_authorization(user, password)}


def get(
    running: Running, context: ssl.SSLContext | None, headers: dict[str, str] | None = None, path: str = "/metrics"
) -> tuple[int, dict[str, str], bytes]:
    scheme = "http" if context is None else "https"
    return net.get(f"{scheme}://{running.host}:{running.port}{path}", headers, TIMEOUT_S, context)


def handshake_refused(running: Running, context: ssl.SSLContext) -> BaseException:
    """The request fails in the TLS layer. With TLS 1.3 the client learns it only at its first read."""
    with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)) as err:
        get(running, context)
    return err.value


# -- TLS and basic auth -------------------------------------------------------------------------------------------


def test_right_password_over_tls_gets_the_metrics_and_the_headers(pki: PKI, serve: Serve) -> None:
    running = serve(
        tls_config(pki)
        + "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n"
        + f"basic_auth_users:\n  prometheus: {HASH}\n"
    )
    status, headers, body = get(running, client_context(pki), basic("prometheus", PASSWORD))
    assert status == 200 and METRICS in body
    assert headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize(
    "headers",
    [basic("prometheus", "wrong"), basic("prometheus", ""), basic("root", PASSWORD), {}, {"Authorization": "Basic x"}],
)
def test_wrong_or_missing_credentials_get_401(pki: PKI, serve: Serve, headers: dict[str, str]) -> None:
    running = serve(
        tls_config(pki)
        + "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
        + f"basic_auth_users:\n  prometheus: {HASH}\n"
    )
    status, response_headers, body = get(running, client_context(pki), headers)
    assert status == 401
    assert response_headers["WWW-Authenticate"] == "Basic"
    assert response_headers["X-Frame-Options"] == "deny"  # headers go on refusals too, as in the toolkit
    assert METRICS not in body


def test_basic_auth_without_tls_works_on_plain_http(serve: Serve) -> None:
    running = serve(f"basic_auth_users:\n  prometheus: {HASH}\n")
    assert get(running, None, basic("prometheus", PASSWORD))[0] == 200
    assert get(running, None, basic("prometheus", "nope"))[0] == 401


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_no_endpoint_accepts_a_write(pki: PKI, serve: Serve, method: str) -> None:
    running = serve(
        tls_config(pki, REQUIRE_CLIENT_CERT.format(ca=pki.ca.cert)) + f"basic_auth_users:\n  prometheus: {HASH}\n"
    )
    conn = http.client.HTTPSConnection(
        running.host, running.port, timeout=TIMEOUT_S, context=client_context(pki, pki.client)
    )
    try:
        conn.request(method, "/metrics", body=b"x", headers=basic("prometheus", PASSWORD))
        response = conn.getresponse()
        assert response.status in (405, 501) and METRICS not in response.read()
    finally:
        conn.close()


# -- client certificates ------------------------------------------------------------------------------------------


def test_a_required_client_certificate_lets_its_holder_in(pki: PKI, serve: Serve) -> None:
    running = serve(tls_config(pki, REQUIRE_CLIENT_CERT.format(ca=pki.ca.cert)))
    assert get(running, client_context(pki, pki.client))[0] == 200


def test_a_missing_client_certificate_is_refused_in_the_handshake(pki: PKI, serve: Serve) -> None:
    running = serve(tls_config(pki, REQUIRE_CLIENT_CERT.format(ca=pki.ca.cert)))
    error = handshake_refused(running, client_context(pki))
    if isinstance(error, ssl.SSLError):
        assert "CERTIFICATE_REQUIRED" in str(error).upper().replace(" ", "_")
    assert get(running, client_context(pki, pki.client))[0] == 200  # the server is still serving


def test_a_client_certificate_from_another_ca_is_refused(pki: PKI, serve: Serve) -> None:
    running = serve(tls_config(pki, REQUIRE_CLIENT_CERT.format(ca=pki.ca.cert)))
    handshake_refused(running, client_context(pki, pki.other_client))


def test_verify_if_given_admits_no_certificate_but_not_a_foreign_one(pki: PKI, serve: Serve) -> None:
    running = serve(tls_config(pki, f"  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {pki.ca.cert}\n"))
    assert get(running, client_context(pki))[0] == 200
    assert get(running, client_context(pki, pki.client))[0] == 200
    handshake_refused(running, client_context(pki, pki.other_client))


def test_client_allowed_sans(pki: PKI, serve: Serve) -> None:
    policy = REQUIRE_CLIENT_CERT.format(ca=pki.ca.cert)
    allowed = serve(tls_config(pki, policy + "  client_allowed_sans: [other.example, scraper.example]\n"))
    assert get(allowed, client_context(pki, pki.client))[0] == 200
    refused = serve(tls_config(pki, policy + "  client_allowed_sans: [other.example]\n"))
    handshake_refused(refused, client_context(pki, pki.client))


# -- protocol mix-ups ---------------------------------------------------------------------------------------------


def test_plain_http_to_the_tls_port_gets_go_s_400(pki: PKI, serve: Serve) -> None:
    running = serve(tls_config(pki))
    with socket.create_connection((running.host, running.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b"".join(iter(lambda: sock.recv(4096), b""))
    assert answer == PLAIN_HTTP_TO_TLS_RESPONSE
    status, _, body = get(running, None)
    assert status == 400 and b"HTTPS server" in body


def test_garbage_to_the_tls_port_is_closed(pki: PKI, serve: Serve) -> None:
    running = serve(tls_config(pki))
    with socket.create_connection((running.host, running.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"\x00\x01\x02\x03\x04 not tls")
        assert sock.recv(4096) == b""
    assert get(running, client_context(pki))[0] == 200


def test_tls_to_the_plain_port_fails_in_the_client(serve: Serve, pki: PKI) -> None:
    running = serve("")
    with pytest.raises(ssl.SSLError):
        get(running, client_context(pki))
    assert get(running, None)[0] == 200


def test_a_client_limited_to_an_older_tls_version_is_refused(pki: PKI, serve: Serve) -> None:
    running = serve(tls_config(pki, "  min_version: TLS13\n"))
    context = client_context(pki)
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    handshake_refused(running, context)
    assert get(running, client_context(pki))[0] == 200


def test_configured_cipher_suites_are_the_ones_negotiated(pki: PKI, serve: Serve) -> None:
    suite = "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384"
    running = serve(tls_config(pki, f"  max_version: TLS12\n  cipher_suites: [{suite}]\n"))
    context = client_context(pki)
    raw = socket.create_connection((running.host, running.port), timeout=TIMEOUT_S)
    with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        name, version, _ = tls.cipher()  # type: ignore[misc]
    assert (name, version) == ("ECDHE-ECDSA-AES256-GCM-SHA384", "TLSv1.2")
    context.set_ciphers("ECDHE-ECDSA-AES128-GCM-SHA256")  # a client that offers only other suites
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    handshake_refused(running, context)


# -- robustness ---------------------------------------------------------------------------------------------------


def test_a_stalled_client_does_not_block_the_others(pki: PKI, serve: Serve) -> None:
    # Handshakes never block: a connection that never speaks TLS must not hold up the others.
    running = serve(tls_config(pki))
    with socket.create_connection((running.host, running.port), timeout=TIMEOUT_S):
        started = time.monotonic()
        assert get(running, client_context(pki))[0] == 200
        assert time.monotonic() - started < 2.0


def test_keep_alive_and_pipelining_over_tls(pki: PKI, serve: Serve) -> None:
    # Decrypted bytes wait in the TLS layer, where the selector cannot see them: two requests in one record.
    running = serve(tls_config(pki))
    raw = socket.create_connection((running.host, running.port), timeout=TIMEOUT_S)
    with client_context(pki).wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        request = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n"
        tls.sendall(request + request)
        answers = Answers(tls)
        first, second = answers.next(TIMEOUT_S), answers.next(TIMEOUT_S)
        tls.sendall(request)
        third = answers.next(TIMEOUT_S)
    assert [answer and answer[0] for answer in (first, second, third)] == [200, 200, 200]


def test_a_stalled_client_is_dropped_after_the_handshake_timeout(pki: PKI, serve: Serve) -> None:
    running = serve(tls_config(pki))
    with socket.create_connection((running.host, running.port), timeout=TIMEOUT_S) as sock:
        started = time.monotonic()
        assert sock.recv(1) == b""  # the server closes it
        waited = time.monotonic() - started
    assert 2.5 < waited < 6, waited


# -- reloads while serving ----------------------------------------------------------------------------------------


def replace(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_new_password_takes_effect_without_a_restart(tmp_path: Path, pki: PKI, serve: Serve) -> None:
    running = serve(tls_config(pki) + f"basic_auth_users:\n  prometheus: {HASH}\n")
    assert get(running, client_context(pki), basic("prometheus", PASSWORD))[0] == 200
    new_hash = bcrypt.hashpw(b"rotated", bcrypt.gensalt(4)).decode()
    replace(tmp_path / "web.yml", tls_config(pki) + f"basic_auth_users:\n  prometheus: {new_hash}\n")
    assert get(running, client_context(pki), basic("prometheus", PASSWORD))[0] == 401
    assert get(running, client_context(pki), basic("prometheus", "rotated"))[0] == 200


def test_a_broken_edit_keeps_serving_the_last_good_config(tmp_path: Path, pki: PKI, serve: Serve) -> None:
    running = serve(tls_config(pki) + f"basic_auth_users:\n  prometheus: {HASH}\n")
    replace(tmp_path / "web.yml", tls_config(pki) + "basic_auth_users:\n  prometheus: plaintext\n")
    assert get(running, client_context(pki), basic("prometheus", PASSWORD))[0] == 200
    assert get(running, client_context(pki), basic("prometheus", "plaintext"))[0] == 401


def test_a_rotated_server_certificate_is_served_to_new_connections(tmp_path: Path, pki: PKI, serve: Serve) -> None:
    own = make_pki(tmp_path / "own")
    running = serve(tls_config(own))
    assert get(running, client_context(own))[0] == 200
    rotated = make_pki(tmp_path / "rotated")  # a new CA: only clients that trust it can connect afterwards
    shutil.copy(rotated.server.cert, own.server.cert)
    shutil.copy(rotated.server.key, own.server.key)
    time.sleep(0.01)  # a different mtime even on coarse-grained filesystems
    os.utime(own.server.key)
    # The server's loop never waits for a check of the files: the first connection after the change starts
    # one and may still get the old certificate; the connections after that check get the new one.
    with contextlib.suppress(ssl.SSLError, ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
        get(running, client_context(own))
    time.sleep(0.3)
    assert get(running, client_context(rotated))[0] == 200
    handshake_refused(running, client_context(own))


# -- curl, a second independent TLS client -------------------------------------------------------------------------

CURL = shutil.which("curl")


def curl(running: Running, pki: PKI, cert: Issued | None, *args: str) -> subprocess.CompletedProcess[str]:
    assert CURL is not None
    command = [CURL, "-sS", "--max-time", str(TIMEOUT_S), "--cacert", str(pki.ca.cert), *args]
    if cert is not None:
        command += ["--cert", str(cert.cert), "--key", str(cert.key)]
    command.append(f"https://127.0.0.1:{running.port}/metrics")
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S * 2, check=False)


@pytest.mark.skipif(CURL is None, reason="curl is not installed")
def test_curl_with_certificate_and_password(pki: PKI, serve: Serve) -> None:
    running = serve(
        tls_config(pki, REQUIRE_CLIENT_CERT.format(ca=pki.ca.cert)) + f"basic_auth_users:\n  prometheus: {HASH}\n"
    )
    ok = curl(running, pki, pki.client, "-u", f"prometheus:{PASSWORD}", "-w", "%{http_code}")
    assert ok.returncode == 0 and METRICS.decode() in ok.stdout and ok.stdout.endswith("200"), ok
    wrong = curl(running, pki, pki.client, "-u", "prometheus:nope", "-o", "/dev/null", "-w", "%{http_code}")
    assert wrong.stdout == "401", wrong
    no_cert = curl(running, pki, None, "-u", f"prometheus:{PASSWORD}")
    assert no_cert.returncode != 0 and METRICS.decode() not in no_cert.stdout, no_cert
