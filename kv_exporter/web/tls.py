"""TLS for the exporter-toolkit web configuration: the server context, and the handshake of each connection.

Go's `crypto/tls` names (client-auth policies, versions, cipher suites) are mapped onto Python's `ssl`; what `ssl`
cannot honour is refused by `kv_exporter.web.config` when the file is read. The handshake itself is the transport's
(`kv_exporter.transport.connection`, on asyncio's TLS); `peer_allowed` is the one check it takes from here.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

# Go's client-auth policy names -> what Python's ssl can do. Go's "request a certificate but do not verify it"
# policies have no Python equivalent (CERT_OPTIONAL verifies whatever is sent), so they are refused.
CLIENT_AUTH_TYPES: Mapping[str, ssl.VerifyMode | None] = MappingProxyType(
    {
        "": ssl.CERT_NONE,
        "NoClientCert": ssl.CERT_NONE,
        "RequestClientCert": None,
        "RequireAnyClientCert": None,
        "RequireClientCert": None,  # the toolkit's old spelling of RequireAnyClientCert
        "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
        "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
    }
)

TLS_VERSIONS: Mapping[str, ssl.TLSVersion] = MappingProxyType(
    {
        "TLS10": ssl.TLSVersion.TLSv1,
        "TLS11": ssl.TLSVersion.TLSv1_1,
        "TLS12": ssl.TLSVersion.TLSv1_2,
        "TLS13": ssl.TLSVersion.TLSv1_3,
    }
)

# Go's tls.CipherSuites() names -> OpenSSL names. TLS 1.3 suites are accepted and, as in Go, not configurable.
TLS13_CIPHER_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")
TLS12_CIPHER_SUITES: Mapping[str, str] = MappingProxyType(
    {
        "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
        "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
        "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
        "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
        "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
        "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
        "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
        "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
        "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
        "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
        "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
        "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
        "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
        "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    }
)


@dataclass(frozen=True)
class TLSSettings:
    """`tls_server_config`, with relative file names already joined to the config file's folder."""

    cert_file: Path | None
    key_file: Path | None
    cert: str | None
    key: str | None = None
    client_ca_file: Path | None = None
    client_ca: str | None = None
    client_auth_type: str = "NoClientCert"
    client_allowed_sans: tuple[str, ...] | None = None
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    max_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True

    def files(self) -> tuple[Path, ...]:
        """The files whose change must reload the config (cert rotation without touching the config file)."""
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p is not None)


class TLSSetupError(ValueError):
    """The certificates, keys or options cannot make a server context; the message says which and why."""


def build_ssl_context(tls: TLSSettings) -> ssl.SSLContext:
    """A server context for `tls`; raises `TLSSetupError` if a file is missing, a certificate is bad, or a TLS
    version in min_version..max_version cannot be negotiated here."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _set_versions(context, tls.min_version, tls.max_version)
    try:
        _require_files(tls)
        _load_server_certificate(context, tls)
        _set_ciphers(context, tls)
        if tls.prefer_server_cipher_suites:
            context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        _require_negotiable_versions(context, tls)  # before the client policy: the probe sends no certificate
        _load_client_policy(context, tls)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise TLSSetupError(_describe(exc)) from exc
    return context


def _set_versions(context: ssl.SSLContext, lowest: ssl.TLSVersion, highest: ssl.TLSVersion) -> None:
    with warnings.catch_warnings():  # TLS 1.0 and 1.1 are deprecated: `_require_negotiable_versions` decides
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version = lowest
        context.maximum_version = highest


def _require_negotiable_versions(context: ssl.SSLContext, tls: TLSSettings) -> None:
    """Every version in min_version..max_version must work for real: OpenSSL 3 accepts `minimum_version = TLSv1`
    and then fails every TLS 1.0 handshake at security level 1 and above. One in-memory handshake per version."""
    for name, version in TLS_VERSIONS.items():
        if tls.min_version <= version <= tls.max_version:
            failure = _handshake_failure(context, version)
            if failure is not None:
                raise ValueError(
                    f"{name} (within min_version..max_version) cannot be negotiated here ({ssl.OPENSSL_VERSION}, "
                    f"security level {context.security_level}): {failure}"
                )


def _handshake_failure(server: ssl.SSLContext, version: ssl.TLSVersion) -> str | None:
    """Why a client speaking only `version` cannot complete a handshake with `server`; None if it can."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    client.set_ciphers("ALL:@SECLEVEL=0")  # the probing client takes anything, so a refusal is the server's
    _set_versions(client, version, version)
    to_client, to_server = ssl.MemoryBIO(), ssl.MemoryBIO()
    ends = (server.wrap_bio(to_server, to_client, server_side=True), client.wrap_bio(to_client, to_server))
    done = [False, False]
    for _ in range(8):  # a handshake takes at most a few round trips
        for index, end in enumerate(ends):
            try:
                end.do_handshake()
                done[index] = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as exc:
                return (exc.reason or str(exc)).lower().replace("_", " ")
        if all(done):
            return None
    return "the handshake did not complete"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.strerror or exc}: {exc.filename}"
    return str(exc) or type(exc).__name__


def _no_key_password() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key; the toolkit has no
    # passphrase option either.
    raise ValueError("the private key is encrypted; the web config has no passphrase option")


def _require_files(tls: TLSSettings) -> None:
    """OpenSSL's errors do not name the file; ours do."""
    for name in ("cert_file", "key_file", "client_ca_file"):
        where = getattr(tls, name)
        if where is not None and not where.is_file():
            raise FileNotFoundError(2, f"{name} not found", str(where))


def _load_server_certificate(context: ssl.SSLContext, tls: TLSSettings) -> None:
    with _PemPath(tls.cert_file, tls.cert) as cert, _PemPath(tls.key_file, tls.key) as key:
        context.load_cert_chain(cert, key, password=_no_key_password)


class _PemPath:
    """A path to PEM text: the configured file, or an anonymous in-memory file (memfd) for inline PEM."""

    def __init__(self, path: Path | None, inline: str | None) -> None:
        self.path = path
        self.inline = inline
        self.fd: int | None = None

    def __enter__(self) -> str:
        if self.path is not None:
            return str(self.path)
        if not hasattr(os, "memfd_create"):
            raise ValueError("inline cert/key needs Linux (memfd); use cert_file/key_file")
        self.fd = os.memfd_create("kv-exporter-web-config", os.MFD_CLOEXEC)
        os.write(self.fd, (self.inline or "").encode())
        return f"/proc/self/fd/{self.fd}"

    def __exit__(self, *_: object) -> None:
        if self.fd is not None:
            os.close(self.fd)


def _load_client_policy(context: ssl.SSLContext, tls: TLSSettings) -> None:
    mode = CLIENT_AUTH_TYPES[tls.client_auth_type]
    assert mode is not None  # unsupported policies were refused while parsing
    if mode == ssl.CERT_NONE:
        return
    if tls.client_ca_file is not None:
        context.load_verify_locations(cafile=str(tls.client_ca_file))
    elif tls.client_ca is not None:
        context.load_verify_locations(cadata=tls.client_ca)
    else:
        # Go verifies client certificates against the system roots when no client CA is given.
        context.load_default_certs(ssl.Purpose.CLIENT_AUTH)
    context.verify_mode = mode


def _set_ciphers(context: ssl.SSLContext, tls: TLSSettings) -> None:
    wanted = [TLS12_CIPHER_SUITES[name] for name in tls.cipher_suites if name in TLS12_CIPHER_SUITES]
    if not wanted:
        return
    context.set_ciphers(":".join(wanted))
    available = {cipher["name"] for cipher in context.get_ciphers()}
    missing = [name for name in wanted if name not in available]
    if missing:
        raise ValueError(f"cipher_suites not available in this OpenSSL: {', '.join(missing)}")


def _normalised_san(value: str) -> str:
    """Go compares SANs as strings, with IPs in canonical form; Python spells IPv6 in full."""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return value


def normalised_sans(sans: tuple[str, ...] | None) -> frozenset[str] | None:
    return None if sans is None else frozenset(_normalised_san(value) for value in sans)


def peer_allowed(peercert: Mapping[str, Any] | None, allowed_sans: frozenset[str] | None) -> bool:
    """`client_allowed_sans`: the verified client certificate must carry one of the listed SANs."""
    if allowed_sans is None:
        return True
    if not peercert:
        return False
    return any(_normalised_san(value) in allowed_sans for _, value in peercert.get("subjectAltName", ()))
