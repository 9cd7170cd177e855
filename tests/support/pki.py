"""A throwaway PKI for the web-config tests: a CA, a server certificate for 127.0.0.1, client certificates
(trusted, from a foreign CA), all made with `cryptography` in the test's temporary folder. The PKI itself is
checked in tests/unit/test_webconfig_pki.py."""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
import ssl
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_LIFETIME = dt.timedelta(days=2)


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclass(frozen=True)
class PKI:
    folder: Path
    ca: Issued
    server: Issued
    client: Issued  # signed by `ca`, SAN DNS:scraper.example
    other_client: Issued  # signed by `foreign_ca`: not trusted by the server
    foreign_ca: Issued


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    cert_path, key_path = folder / f"{stem}.crt", folder / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return Issued(cert_path, key_path)


def _builder(subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _LIFETIME)
    )


def make_ca(folder: Path, stem: str) -> tuple[Issued, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(f"kv-exporter test {stem}", _name(f"kv-exporter test {stem}"), key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _write(folder, stem, cert, key), cert, key


def issue(
    folder: Path,
    stem: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    sans: list[x509.GeneralName],
    usage: x509.ObjectIdentifier,
) -> Issued:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(stem, ca_cert.subject, key)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _write(folder, stem, cert, key)


def make_pki(folder: Path) -> PKI:
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_cert, ca_key = make_ca(folder, "ca")
    foreign, foreign_cert, foreign_key = make_ca(folder, "foreign-ca")
    server_sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    server = issue(folder, "server", (ca_cert, ca_key), server_sans, ExtendedKeyUsageOID.SERVER_AUTH)
    client_sans: list[x509.GeneralName] = [x509.DNSName("scraper.example")]
    client = issue(folder, "client", (ca_cert, ca_key), client_sans, ExtendedKeyUsageOID.CLIENT_AUTH)
    other = issue(folder, "other-client", (foreign_cert, foreign_key), client_sans, ExtendedKeyUsageOID.CLIENT_AUTH)
    return PKI(folder=folder, ca=ca, server=server, client=client, other_client=other, foreign_ca=foreign)


def client_context(pki: PKI, cert: Issued | None = None) -> ssl.SSLContext:
    """A strict client: verifies the server against the test CA and its name; optionally presents `cert`."""
    context = ssl.create_default_context(cafile=str(pki.ca.cert))
    if cert is not None:
        context.load_cert_chain(str(cert.cert), str(cert.key))
    return context


def negotiable(pki: PKI, version: ssl.TLSVersion) -> bool:
    """Whether this platform's OpenSSL, as Python sets it up, completes a handshake at `version` with the test
    server certificate, over a real socket pair and an old client that takes any cipher. What a test expects of
    `min_version: TLS10` depends on it: OpenSSL 3 refuses TLS 1.0 and 1.1 at security level 1 and above."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(pki.server.cert), str(pki.server.key))
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    client.set_ciphers("ALL:@SECLEVEL=0")
    with warnings.catch_warnings():  # TLS 1.0 and 1.1 are deprecated: that is what is being asked
        warnings.simplefilter("ignore", DeprecationWarning)
        for context in (server, client):
            context.minimum_version = context.maximum_version = version
    ours, theirs = socket.socketpair()
    accepting = threading.Thread(target=_accept_quietly, args=(server, ours))
    accepting.start()
    try:
        client.wrap_socket(theirs).close()
        return True
    except OSError:  # ssl.SSLError among them
        return False
    finally:
        theirs.close()  # the server side, if still waiting, sees the end and gives up
        accepting.join(10)
        ours.close()


def _accept_quietly(context: ssl.SSLContext, sock: socket.socket) -> None:
    try:
        context.wrap_socket(sock, server_side=True).close()
    except OSError:
        sock.close()
