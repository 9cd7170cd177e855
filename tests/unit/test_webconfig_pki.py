"""The throwaway PKI of the web-config tests (tests.support.pki) checked on its own, so that a TLS test failure
points at the server, not at a broken certificate."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from cryptography import x509

from tests.support.pki import client_context, make_pki


def test_pki_chains_verify(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    ca = x509.load_pem_x509_certificate(pki.ca.cert.read_bytes())
    for issued in (pki.server, pki.client):
        x509.load_pem_x509_certificate(issued.cert.read_bytes()).verify_directly_issued_by(ca)
    other = x509.load_pem_x509_certificate(pki.other_client.cert.read_bytes())
    with pytest.raises(ValueError, match="issuer"):
        other.verify_directly_issued_by(ca)


def test_pki_loads_into_python_ssl(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(pki.server.cert), str(pki.server.key))
    assert client_context(pki, pki.client).verify_mode == ssl.CERT_REQUIRED
