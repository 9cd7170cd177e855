"""`--web.config.file`: the Prometheus exporter-toolkit web configuration, read as strictly as the toolkit reads it.

The file format is the toolkit's (docs/web-configuration.md in prometheus/exporter-toolkit): `tls_server_config`
(server certificate and key, client-certificate policy and CAs, allowed client SANs, TLS versions, cipher suites),
`http_server_config` (`http2`, `headers` from the toolkit's short allow-list) and `basic_auth_users` (bcrypt hashes).
Reading is as strict as the toolkit's `yaml.UnmarshalStrict`: unknown keys, duplicate keys and wrong types are
errors. Options the toolkit documents but Python's `ssl` module cannot honour are refused with the reason, never
silently ignored (see `UNSUPPORTED`). Needs the `web` extra (pyyaml, bcrypt).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from kv_exporter.filestat import NotARegularFile, read_regular_file
from kv_exporter.web.auth import BasicAuth, is_bcrypt_hash
from kv_exporter.web.tls import (
    CLIENT_AUTH_TYPES,
    TLS12_CIPHER_SUITES,
    TLS13_CIPHER_SUITES,
    TLS_VERSIONS,
    TLSSettings,
    TLSSetupError,
    build_ssl_context,
    normalised_sans,
)

MAX_CONFIG_BYTES = 1 << 20

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


class WebConfigError(ValueError):
    """The web config file cannot be used; the message names the file and the offending key."""

    def __init__(self, path: str | os.PathLike[str], detail: str) -> None:
        super().__init__(f"{os.fspath(path)}: {detail}")
        self.path = os.fspath(path)
        self.detail = detail


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
        try:
            self._context = None if tls is None else build_ssl_context(tls)
        except TLSSetupError as exc:
            raise WebConfigError(path, f"tls_server_config: {exc}") from exc
        self.allowed_sans = None if tls is None else normalised_sans(tls.client_allowed_sans)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> WebConfig:
        """Read, validate and build; raises `WebConfigError` for anything unusable."""
        source = Path(path)
        try:  # opened without blocking, as manifests are: a FIFO put in its place must not hang the reader
            data = read_regular_file(str(source), MAX_CONFIG_BYTES + 1)
        except NotARegularFile as exc:
            raise WebConfigError(source, f"cannot read: {exc}") from exc
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

    def known_auth(self, authorization: str | None) -> bool | None:
        """What `check_auth` answers without running bcrypt; None when it would run it (a credential not cached)."""
        return self._auth.known(authorization)

    def watched_files(self) -> tuple[Path, ...]:
        return (self.path, *(self.tls.files() if self.tls is not None else ()))


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
            if not is_bcrypt_hash(hashed):
                raise self.fail(f"basic_auth_users.{user}: not a bcrypt hash ($2a$/$2b$/$2y$, cost 04-31)")
            users[user] = hashed.encode("ascii")
        return users


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__
