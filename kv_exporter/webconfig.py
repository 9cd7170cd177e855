"""`--web.config.file`: the Prometheus exporter-toolkit web configuration, for a Python server.

The file format is the toolkit's (docs/web-configuration.md in prometheus/exporter-toolkit): `tls_server_config`
(server certificate and key, client-certificate policy and CAs, allowed client SANs, TLS versions, cipher suites),
`http_server_config` (`http2`, `headers` from the toolkit's short allow-list) and `basic_auth_users` (bcrypt hashes).
Reading is as strict as the toolkit's `yaml.UnmarshalStrict`: unknown keys, duplicate keys and wrong types are
errors. Options the toolkit documents but Python's `ssl` module cannot honour are refused with the reason, never
silently ignored (see `UNSUPPORTED`).

Serving: `WebConfigReloader` re-reads the file (and the certificate files it names) when they change, at most once
a second, and keeps the last good configuration when a new one is invalid. `WebConfigServerMixin` does the TLS
handshake per connection in the worker thread (so a slow client cannot stall the accept loop) and answers plain
HTTP sent to the TLS port the way Go does; `WebConfigHandlerMixin` adds basic auth and the configured headers to an
`http.server` handler; `WebConfigMiddleware` does the same for a WSGI app. Needs the `web` extra (pyyaml, bcrypt).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import socket
import socketserver
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import MappingProxyType
from typing import Any

import bcrypt
import yaml
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger("kv_exporter.webconfig")

MAX_CONFIG_BYTES = 1 << 20
RELOAD_CHECK_INTERVAL_S = 1.0
HANDSHAKE_TIMEOUT_S = 10.0
LINGER_S = 0.5  # how long a refused connection may keep sending before it is closed
AUTH_CACHE_SIZE = 100  # the toolkit's cache size (web/cache.go)
BCRYPT_MAX_PASSWORD_BYTES = 72  # bcrypt only ever uses the first 72 bytes of a password

# The toolkit's allow-list of response headers (web/handler.go `extraHTTPHeaders`): name -> accepted values
# (empty: any value). Everything else is refused, so no config can set Content-Type, Set-Cookie, ...
ALLOWED_HEADERS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "Strict-Transport-Security": (),
        "X-Content-Type-Options": ("nosniff",),
        "X-Frame-Options": ("deny", "sameorigin"),
        "X-XSS-Protection": (),
        "Content-Security-Policy": (),
    }
)

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

# Documented toolkit options this server refuses, with the reason (a config using them fails to load).
UNSUPPORTED: Mapping[str, str] = MappingProxyType(
    {
        "rate_limit": "rate limiting is not implemented by kv-exporter; put a proxy in front if you need it",
        "tls_server_config.curve_preferences": "Python's ssl module cannot set a list of curves",
    }
)

_TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit")
_TLS_KEYS = (
    "cert",
    "key",
    "client_ca",
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "client_allowed_sans",
    "min_version",
    "max_version",
    "cipher_suites",
    "prefer_server_cipher_suites",
    "curve_preferences",
)
_HTTP_KEYS = ("http2", "headers")

# Go's bcrypt accepts $2a$/$2b$/$2y$ (htpasswd writes $2y$), cost 4..31, 22 salt + 31 hash characters.
_BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")

# What Go's net/http answers when plain HTTP reaches a TLS port, and the record starts it recognises as HTTP.
PLAIN_HTTP_TO_TLS_RESPONSE = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
_HTTP_RECORD_STARTS = (b"GET /", b"HEAD ", b"POST ", b"PUT /", b"OPTIO")
_TLS_HANDSHAKE_RECORD = 0x16


class WebConfigError(ValueError):
    """The web config file cannot be used; the message names the file and the offending key."""

    def __init__(self, path: str | os.PathLike[str], detail: str) -> None:
        super().__init__(f"{os.fspath(path)}: {detail}")
        self.path = os.fspath(path)
        self.detail = detail


# -- the parsed configuration -------------------------------------------------------------------------------


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


class WebConfig:
    """One loaded web config. `ssl_context()` is built at load time, so a bad certificate fails the load."""

    def __init__(
        self,
        path: Path,
        tls: TLSSettings | None,
        headers: Mapping[str, str],
        users: Mapping[str, bytes],
        http2: bool = True,
    ) -> None:
        self.path = path
        self.tls = tls
        self.http2 = http2  # accepted for compatibility; this server speaks HTTP/1.1 only
        self._headers = MappingProxyType(dict(headers))
        self._auth = BasicAuth(users)
        self._context = None if tls is None else build_ssl_context(tls, path)
        self._allowed_sans = None if tls is None else _normalised_sans(tls.client_allowed_sans)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> WebConfig:
        """Read, validate and build; raises `WebConfigError` for anything unusable."""
        source = Path(path)
        try:
            with open(source, "rb") as handle:
                data = handle.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise WebConfigError(source, f"cannot read: {exc.strerror or exc}") from exc
        return cls.parse(data, source)

    @classmethod
    def parse(cls, data: bytes, path: Path) -> WebConfig:
        if len(data) > MAX_CONFIG_BYTES:
            raise WebConfigError(path, f"larger than {MAX_CONFIG_BYTES} bytes")
        return _Parser(path).config(_load_yaml(data, path))

    @property
    def headers(self) -> Mapping[str, str]:
        """Headers to add to every response (401s included, as the toolkit does)."""
        return self._headers

    @property
    def tls_enabled(self) -> bool:
        return self._context is not None

    @property
    def auth_required(self) -> bool:
        return self._auth.enabled

    def ssl_context(self) -> ssl.SSLContext | None:
        return self._context

    def check_auth(self, authorization: str | None) -> bool:
        """True when no users are configured, or the `Authorization` header holds a valid user and password."""
        return self._auth.check(authorization)

    def peer_allowed(self, peercert: Mapping[str, Any] | None) -> bool:
        """`client_allowed_sans`: the verified client certificate must carry one of the listed SANs."""
        if self._allowed_sans is None:
            return True
        if not peercert:
            return False
        return any(_normalised_san(value) in self._allowed_sans for _, value in peercert.get("subjectAltName", ()))

    def watched_files(self) -> tuple[Path, ...]:
        return (self.path, *(self.tls.files() if self.tls is not None else ()))


# -- YAML, strictly ---------------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no type hints
    """SafeLoader that refuses duplicate keys, as Go's yaml.UnmarshalStrict does (PyYAML keeps the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    result: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in result
        except TypeError:  # an unhashable key (a list or map used as a key)
            raise yaml.constructor.ConstructorError(None, None, "unhashable key", key_node.start_mark) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        result[key] = loader.construct_object(value_node, deep=True)
    return result


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _load_yaml(data: bytes, path: Path) -> object:
    try:
        return yaml.load(data, Loader=_StrictLoader)  # a SafeLoader: builds only plain data
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise WebConfigError(path, f"invalid YAML: {str(exc)[:300]}") from exc


# -- validation -------------------------------------------------------------------------------------------------


class _Parser:
    """Turns the decoded YAML into a `WebConfig`, raising the first problem as a `WebConfigError`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.folder = path.parent

    def fail(self, detail: str) -> WebConfigError:
        return WebConfigError(self.path, detail)

    def config(self, doc: object) -> WebConfig:
        top = self.mapping({} if doc is None else doc, "the document", _TOP_KEYS)
        http = self.mapping(top.get("http_server_config") or {}, "http_server_config", _HTTP_KEYS)
        return WebConfig(
            path=self.path,
            tls=self.tls(self.mapping(top.get("tls_server_config") or {}, "tls_server_config", _TLS_KEYS)),
            headers=self.headers(http.get("headers")),
            users=self.users(top.get("basic_auth_users")),
            http2=self.boolean(http, "http2", "http_server_config", default=True),
        )

    def mapping(self, doc: object, where: str, keys: tuple[str, ...]) -> Mapping[str, Any]:
        if not isinstance(doc, dict):
            raise self.fail(f"{where} must be a mapping, got {_kind(doc)}")
        for key in doc:
            if not isinstance(key, str) or key not in keys:
                raise self.fail(f"unknown key {key!r} in {where} (allowed: {', '.join(keys)})")
            dotted = key if where == "the document" else f"{where}.{key}"
            if dotted in UNSUPPORTED and doc[key] is not None:
                raise self.fail(f"{dotted} is not supported: {UNSUPPORTED[dotted]}")
        return doc

    def string(self, obj: Mapping[str, Any], key: str, where: str) -> str:
        value = obj.get(key)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise self.fail(f"{where}.{key} must be a string, got {_kind(value)} (quote it)")
        return value

    def boolean(self, obj: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
        value = obj.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"{where}.{key} must be true or false, got {_kind(value)}")
        return value

    def strings(self, obj: Mapping[str, Any], key: str, where: str) -> tuple[str, ...] | None:
        value = obj.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.fail(f"{where}.{key} must be a list of strings")
        return tuple(value)

    def file(self, obj: Mapping[str, Any], key: str) -> Path | None:
        name = self.string(obj, key, "tls_server_config")
        # Relative names are relative to the config file's folder, as in the toolkit (SetDirectory).
        return (self.folder / name) if name else None

    def tls(self, obj: Mapping[str, Any]) -> TLSSettings | None:
        where = "tls_server_config"
        settings = TLSSettings(
            cert_file=self.file(obj, "cert_file"),
            key_file=self.file(obj, "key_file"),
            cert=self.string(obj, "cert", where) or None,
            key=self.string(obj, "key", where) or None,
            client_ca_file=self.file(obj, "client_ca_file"),
            client_ca=self.string(obj, "client_ca", where) or None,
            client_auth_type=self.client_auth(self.string(obj, "client_auth_type", where)),
            client_allowed_sans=self.strings(obj, "client_allowed_sans", where),
            min_version=self.version(obj, "min_version", ssl.TLSVersion.TLSv1_2),
            max_version=self.version(obj, "max_version", ssl.TLSVersion.TLSv1_3),
            cipher_suites=self.ciphers(self.strings(obj, "cipher_suites", where) or ()),
            prefer_server_cipher_suites=self.boolean(obj, "prefer_server_cipher_suites", where, default=True),
        )
        # The toolkit serves TLS when any of these is set (TLSConfig.IsEnabled); other keys alone do not.
        enabling = ("cert_file", "key_file", "cert", "key", "client_ca_file", "client_ca", "client_auth_type")
        if not any(obj.get(key) for key in enabling):
            return None
        self.check_tls(settings, obj)
        return settings

    def check_tls(self, tls: TLSSettings, obj: Mapping[str, Any]) -> None:
        if tls.cert_file is None and tls.cert is None:
            raise self.fail("tls_server_config: missing one of cert or cert_file")
        if tls.key_file is None and tls.key is None:
            raise self.fail("tls_server_config: missing one of key or key_file")
        for inline, named in (("cert", "cert_file"), ("key", "key_file"), ("client_ca", "client_ca_file")):
            if obj.get(inline) and obj.get(named):
                raise self.fail(f"tls_server_config: set {inline} or {named}, not both")
        has_ca = tls.client_ca_file is not None or tls.client_ca is not None
        if has_ca and CLIENT_AUTH_TYPES[tls.client_auth_type] == ssl.CERT_NONE:
            raise self.fail("tls_server_config: client CA's have been configured without a Client Auth Policy")
        if tls.client_allowed_sans is not None and tls.client_auth_type != "RequireAndVerifyClientCert":
            raise self.fail("tls_server_config.client_allowed_sans needs client_auth_type RequireAndVerifyClientCert")
        if tls.min_version > tls.max_version:
            raise self.fail("tls_server_config: min_version is above max_version")
        only_tls13 = tls.cipher_suites and not any(name in TLS12_CIPHER_SUITES for name in tls.cipher_suites)
        if only_tls13 and tls.min_version < ssl.TLSVersion.TLSv1_3:
            raise self.fail("tls_server_config.cipher_suites names no TLS 1.2 suite: set min_version: TLS13")

    def client_auth(self, name: str) -> str:
        if name not in CLIENT_AUTH_TYPES:
            raise self.fail(f"tls_server_config.client_auth_type: invalid ClientAuth: {name}")
        if CLIENT_AUTH_TYPES[name] is None:
            raise self.fail(
                f"tls_server_config.client_auth_type {name} is not supported: Python's ssl module cannot request a "
                "client certificate without verifying it; use VerifyClientCertIfGiven or RequireAndVerifyClientCert"
            )
        return name or "NoClientCert"

    def version(self, obj: Mapping[str, Any], key: str, default: ssl.TLSVersion) -> ssl.TLSVersion:
        name = self.string(obj, key, "tls_server_config")
        if not name:
            return default
        if name not in TLS_VERSIONS:
            raise self.fail(f"tls_server_config.{key}: unknown TLS version: {name}")
        return TLS_VERSIONS[name]

    def ciphers(self, names: Iterable[str]) -> tuple[str, ...]:
        for name in names:
            if name not in TLS12_CIPHER_SUITES and name not in TLS13_CIPHER_SUITES:
                raise self.fail(f"tls_server_config.cipher_suites: unknown cipher: {name}")
        return tuple(names)

    def headers(self, doc: object) -> dict[str, str]:
        if doc is None:
            return {}
        if not isinstance(doc, dict):
            raise self.fail(f"http_server_config.headers must be a mapping, got {_kind(doc)}")
        result: dict[str, str] = {}
        for name, value in doc.items():
            if name not in ALLOWED_HEADERS:
                raise self.fail(f'HTTP header "{name}" can not be configured')
            if value is None or value == "":
                continue  # "Unset if blank"
            if not isinstance(value, str) or "\r" in value or "\n" in value:
                raise self.fail(f"http_server_config.headers.{name} must be a one-line string")
            allowed = ALLOWED_HEADERS[name]
            if allowed and value not in allowed:
                raise self.fail(f"invalid value for {name}. Expected one of: {list(allowed)}, but got: {value!r}")
            result[name] = value
        return result

    def users(self, doc: object) -> dict[str, bytes]:
        if doc is None:
            return {}
        if not isinstance(doc, dict):
            raise self.fail(f"basic_auth_users must be a mapping, got {_kind(doc)}")
        users: dict[str, bytes] = {}
        for user, hashed in doc.items():
            if not isinstance(user, str) or not isinstance(hashed, str):
                raise self.fail("basic_auth_users: user names and hashes must be strings")
            if ":" in user:
                raise self.fail(f"basic_auth_users: user {user!r} contains ':' and could never log in")
            if not _BCRYPT_HASH.fullmatch(hashed):
                raise self.fail(f"basic_auth_users.{user}: not a bcrypt hash ($2a$/$2b$/$2y$, cost 04-31)")
            users[user] = hashed.encode("ascii")
        return users


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__


# -- TLS --------------------------------------------------------------------------------------------------------


def build_ssl_context(tls: TLSSettings, config_path: Path) -> ssl.SSLContext:
    """A server context for `tls`; raises `WebConfigError` if a file is missing or a certificate is bad."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = tls.min_version
    context.maximum_version = tls.max_version
    try:
        _require_files(tls)
        _load_server_certificate(context, tls)
        _load_client_policy(context, tls)
        _set_ciphers(context, tls)
    except (OSError, ssl.SSLError, ValueError) as exc:
        if isinstance(exc, WebConfigError):
            raise
        raise WebConfigError(config_path, f"tls_server_config: {_describe(exc)}") from exc
    if tls.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    return context


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


def _normalised_sans(sans: tuple[str, ...] | None) -> frozenset[str] | None:
    return None if sans is None else frozenset(_normalised_san(value) for value in sans)


# -- basic auth -------------------------------------------------------------------------------------------------


class BasicAuth:
    """Basic-auth check against bcrypt hashes, with a bounded cache of bcrypt results.

    A scrape every 15 s must not pay bcrypt (~50 ms at cost 10) each time, so results are cached per
    (user, hash, password), like the toolkit. Cache keys are HMACs under a per-process random key: the cache
    never holds a password, and lookups reveal nothing through timing. Unknown users are checked against a
    dummy hash so that response times do not tell which users exist; bcrypt runs one at a time so a flood of
    wrong passwords costs at most one core.
    """

    def __init__(self, users: Mapping[str, bytes]) -> None:
        self._users = dict(users)
        self._key = secrets.token_bytes(32)
        self._cache: OrderedDict[bytes, bool] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()
        self.bcrypt_calls = 0  # for tests and diagnostics: how often the cache missed

    @property
    def enabled(self) -> bool:
        return bool(self._users)

    def check(self, authorization: str | None) -> bool:
        if not self._users:
            return True
        credentials = parse_basic_authorization(authorization)
        if credentials is None:
            return False
        user, password = credentials
        try:
            hashed = self._users.get(user.decode("utf-8"))
        except UnicodeDecodeError:
            hashed = None
        # An unknown user still costs one bcrypt (cached), against a dummy hash, so timing hides who exists.
        ok = self._cached_check(user, password[:BCRYPT_MAX_PASSWORD_BYTES], hashed or _dummy_hash())
        return ok and hashed is not None

    def _cached_check(self, user: bytes, password: bytes, hashed: bytes) -> bool:
        key = hmac.new(self._key, b"\0".join((user, hashed, password)), hashlib.sha256).digest()
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        with self._bcrypt_lock:
            self.bcrypt_calls += 1
            ok = _bcrypt_matches(password, hashed)
        with self._cache_lock:
            self._cache[key] = ok
            while len(self._cache) > AUTH_CACHE_SIZE:
                self._cache.popitem(last=False)
        return ok


def _bcrypt_matches(password: bytes, hashed: bytes) -> bool:
    try:
        return bool(bcrypt.checkpw(password, hashed))
    except ValueError:  # a NUL byte or another input bcrypt refuses: no match
        return False


_DUMMY: list[bytes] = []


def _dummy_hash() -> bytes:
    """A valid cost-10 hash of a random password (the toolkit's choice of cost), made on first use."""
    if not _DUMMY:
        _DUMMY.append(bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(10)))
    return _DUMMY[0]


def parse_basic_authorization(header: str | None) -> tuple[bytes, bytes] | None:
    """(user, password) from `Basic base64(user:password)`, parsed as Go's net/http does; None if malformed."""
    prefix = "basic "
    if header is None or len(header) < len(prefix) or header[: len(prefix)].lower() != prefix:
        return None
    try:
        decoded = base64.b64decode(header[len(prefix) :].encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        return None
    user, colon, password = decoded.partition(b":")
    return (user, password) if colon else None


# -- reloading --------------------------------------------------------------------------------------------------

_Fingerprint = tuple[tuple[str, tuple[int, ...] | str], ...]


def _fingerprint(paths: Iterable[Path]) -> _Fingerprint:
    """Identity and version of each file: inode, device, size, mtime (a Kubernetes secret swap changes the inode)."""
    result: list[tuple[str, tuple[int, ...] | str]] = []
    for path in paths:
        try:
            st = os.stat(path)
            result.append((str(path), (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)))
        except OSError as exc:
            result.append((str(path), f"error {exc.errno}"))
    return tuple(result)


def _load_with_fingerprint(path: Path) -> tuple[WebConfig, _Fingerprint]:
    """Load, and fingerprint the files the config names (a new config may name other certificates).

    The config file is stat-ed before it is read: if it changes in between, the stored fingerprint is already
    out of date and the next check reloads, instead of missing the change.
    """
    before = _fingerprint([path])
    config = WebConfig.load(path)
    return config, before + _fingerprint(config.watched_files()[1:])


class WebConfigReloader:
    """The current `WebConfig`, re-read when the file or a certificate it names changes.

    The first load raises `WebConfigError` (refuse to start, as the toolkit does). Later, a changed file is
    re-read at most once per `interval`; an invalid new version is logged once and the last good config stays
    in force. Whether TLS is on is fixed at start-up (the listener was built for it), so a change that turns it
    on or off is refused until a restart.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        interval: float = RELOAD_CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._config, self._fingerprint = _load_with_fingerprint(self.path)
        self._checked_at = clock()
        self._failed: _Fingerprint | None = None
        self.reloads = 0
        self.reload_failures = 0
        self.last_error: str | None = None

    @property
    def last_reload_ok(self) -> bool:
        return self.last_error is None

    def current(self) -> WebConfig:
        """The config in force; checks for changes when the last check is older than the interval."""
        if self._clock() - self._checked_at < self._interval:
            return self._config
        with self._lock:
            if self._clock() - self._checked_at >= self._interval:
                self._checked_at = self._clock()
                self._maybe_reload()
            return self._config

    def _maybe_reload(self) -> None:
        fingerprint = _fingerprint(self._config.watched_files())
        if fingerprint == self._fingerprint or fingerprint == self._failed:
            return
        try:
            config, new_fingerprint = _load_with_fingerprint(self.path)
            if config.tls_enabled != self._config.tls_enabled:
                state = "on" if self._config.tls_enabled else "off"
                raise WebConfigError(self.path, f"TLS was {state} at start-up; turning it over needs a restart")
        except WebConfigError as exc:
            self._failed = fingerprint
            self.reload_failures += 1
            self.last_error = str(exc)
            logger.error("web config not reloaded, keeping the previous one: %s", exc)
            return
        self._config, self._fingerprint, self._failed = config, new_fingerprint, None
        self.reloads += 1
        self.last_error = None
        logger.info("web config reloaded from %s", self.path)


RELOAD_METRIC = "model_local_kv_web_config_last_reload_successful"


class ReloadStatusCollector(Collector):
    """Whether the last change to the web config (or a certificate it names) could be loaded, as a metric."""

    def __init__(self, reloader: WebConfigReloader) -> None:
        self.reloader = reloader

    def collect(self) -> Iterable[Metric]:
        self.reloader.current()  # notice an edit even if no request looked since (at most one check a second)
        yield GaugeMetricFamily(
            RELOAD_METRIC,
            "1 if the web config in force is the file as it is now; 0 while a broken edit is refused and the "
            "last good config serves.",
            value=int(self.reloader.last_reload_ok),
        )


# -- serving ----------------------------------------------------------------------------------------------------


def accept_connection(
    sock: socket.socket, config: WebConfig, timeout: float = HANDSHAKE_TIMEOUT_S
) -> socket.socket | None:
    """The connection to serve: `sock` itself without TLS, the TLS socket after a handshake, or None (closed).

    Call it in the thread that serves the connection, not in the accept loop. Plain HTTP sent to a TLS port gets
    Go's 400 answer; a failed handshake (wrong or missing client certificate, no common version) is logged at
    debug level only, since scanners would otherwise flood the log.
    """
    context = config.ssl_context()
    if context is None:
        return sock
    previous_timeout = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        if not _starts_tls(sock):
            _linger_close(sock)
            return None
        conn = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    except OSError as exc:
        logger.debug("TLS connection refused before the handshake: %s", exc)
        sock.close()
        return None
    try:
        conn.do_handshake()
        if not config.peer_allowed(conn.getpeercert()):
            raise ssl.SSLError("client certificate carries none of client_allowed_sans")
    except OSError as exc:
        logger.debug("TLS handshake failed: %s", exc)
        _linger_close(conn)
        return None
    conn.settimeout(previous_timeout)
    return conn


def _linger_close(sock: socket.socket) -> None:
    """Close after the peer has seen our last bytes (a TLS alert, Go's 400 answer).

    Closing with unread input makes the kernel send a reset, which can destroy those bytes before the client reads
    them; so shut down our side, read what the client still sends for a moment, then close.
    """
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(LINGER_S)
        for _ in range(16):
            if not sock.recv(4096):
                break
    sock.close()


def _starts_tls(sock: socket.socket) -> bool:
    """Peek at the first bytes: a TLS handshake record goes on; HTTP gets Go's 400 answer; anything else closes."""
    head = sock.recv(5, socket.MSG_PEEK)
    if head[:1] == bytes([_TLS_HANDSHAKE_RECORD]):
        return True
    if head.startswith(_HTTP_RECORD_STARTS):
        sock.sendall(PLAIN_HTTP_TO_TLS_RESPONSE)
    return False


class WebConfigServerMixin(socketserver.BaseServer):
    """TLS per connection for a socketserver-based HTTP server. Put it first:

        class Server(WebConfigServerMixin, ThreadingHTTPServer): ...
        server = Server((host, port), Handler); server.web_config = WebConfigReloader(path)

    The handshake runs in `finish_request`, i.e. in the worker thread with ThreadingMixIn, with a timeout.
    """

    web_config: WebConfigReloader | None = None
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.web_config is None:
            super().finish_request(request, client_address)
            return
        conn = accept_connection(request, self.web_config.current(), self.handshake_timeout_s)
        if conn is None:
            return
        if conn is request:
            super().finish_request(request, client_address)
            return
        # The TLS socket took over the file descriptor: close it here, shutdown_request sees a detached socket.
        try:
            super().finish_request(conn, client_address)
        finally:
            _close_quietly(conn)


def _close_quietly(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
    conn.close()


class WebConfigHandlerMixin(BaseHTTPRequestHandler):
    """Basic auth and the configured headers for an `http.server` handler. Put it first, and in each do_GET:

    `if not self.authorize(): return` (the 401 is already sent).
    """

    server: Any

    def web_config(self) -> WebConfig | None:
        reloader = getattr(self.server, "web_config", None)
        return reloader.current() if isinstance(reloader, WebConfigReloader) else None

    def authorize(self) -> bool:
        config = self.web_config()
        if config is None or config.check_auth(self.headers.get("Authorization")):
            return True
        body = b"Unauthorized\n"
        self.send_response(401)
        self.send_header("WWW-Authenticate", "Basic")
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        return False

    def end_headers(self) -> None:
        config = self.web_config()
        for name, value in (config.headers if config is not None else {}).items():
            self.send_header(name, value)
        super().end_headers()


_StartResponse = Callable[..., Any]
_WSGIApp = Callable[[dict[str, Any], _StartResponse], Iterable[bytes]]


class WebConfigMiddleware:
    """The same basic auth and headers for a WSGI app (e.g. prometheus_client.make_wsgi_app())."""

    def __init__(self, app: _WSGIApp, reloader: WebConfigReloader) -> None:
        self.app = app
        self.reloader = reloader

    def __call__(self, environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        config = self.reloader.current()
        extra = list(config.headers.items())
        if not config.check_auth(environ.get("HTTP_AUTHORIZATION")):
            start_response(
                "401 Unauthorized",
                [("WWW-Authenticate", "Basic"), ("Content-Type", "text/plain; charset=utf-8"), *extra],
            )
            return [b"Unauthorized\n"]

        def with_headers(status: str, headers: list[tuple[str, str]], *exc_info: Any) -> Any:
            return start_response(status, [*headers, *extra], *exc_info)

        return self.app(environ, with_headers)
