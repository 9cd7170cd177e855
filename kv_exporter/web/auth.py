"""Basic auth for the exporter-toolkit web configuration: bcrypt hashes, checked as the toolkit checks them."""

from __future__ import annotations

import base64
import binascii
import hmac
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping

import bcrypt

AUTH_CACHE_SIZE = 100  # the toolkit's cache size (web/cache.go)
BCRYPT_MAX_PASSWORD_BYTES = 72  # bcrypt only ever uses the first 72 bytes of a password
# Go's bcrypt accepts $2a$/$2b$/$2y$ (htpasswd writes $2y$), cost 4..31, 22 salt + 31 hash characters.
_BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")


def is_bcrypt_hash(text: str) -> bool:
    return _BCRYPT_HASH.fullmatch(text) is not None


class BasicAuth:
    """Basic-auth check against bcrypt hashes, with a bounded cache of bcrypt results.

    A scrape every 15 s must not pay bcrypt (~50 ms at cost 10) each time, so results are cached per
    (user, hash, password), like the toolkit; matches and refusals in caches of their own, so that a flood of wrong
    passwords cannot push a verified credential out. Cache keys are HMACs under a per-process random key: the cache
    never holds a password, and lookups reveal nothing through timing. Unknown users are checked against a
    dummy hash so that response times do not tell which users exist; bcrypt runs one at a time so a flood of
    wrong passwords costs at most one core. `known` answers from the caches alone, so that the server can keep
    requests that need bcrypt away from the workers that answer verified ones.
    """

    def __init__(self, users: Mapping[str, bytes]) -> None:
        self._users = dict(users)
        self._key = secrets.token_bytes(32)
        self._matches: OrderedDict[bytes, None] = OrderedDict()
        self._refusals: OrderedDict[bytes, None] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()
        self.bcrypt_calls = 0  # for tests and diagnostics: how often the cache missed

    @property
    def enabled(self) -> bool:
        return bool(self._users)

    def check(self, authorization: str | None) -> bool:
        return self._check(authorization, bcrypt_allowed=True) is True

    def known(self, authorization: str | None) -> bool | None:
        """The answer `check` gives without running bcrypt, or None when it would have to run it."""
        return self._check(authorization, bcrypt_allowed=False)

    def _check(self, authorization: str | None, bcrypt_allowed: bool) -> bool | None:
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
        password = password[:BCRYPT_MAX_PASSWORD_BYTES]
        key = hmac.new(self._key, b"\0".join((user, hashed or b"", password)), "sha256").digest()
        ok = self._cached(key)
        if ok is None and bcrypt_allowed:
            ok = self._verify(key, password, hashed or _dummy_hash())
        return None if ok is None else ok and hashed is not None

    def _cached(self, key: bytes) -> bool | None:
        with self._cache_lock:
            for cache, result in ((self._matches, True), (self._refusals, False)):
                if key in cache:
                    cache.move_to_end(key)
                    return result
        return None

    def _verify(self, key: bytes, password: bytes, hashed: bytes) -> bool:
        with self._bcrypt_lock:
            self.bcrypt_calls += 1
            ok = _bcrypt_matches(password, hashed)
        with self._cache_lock:
            cache = self._matches if ok else self._refusals
            cache[key] = None
            while len(cache) > AUTH_CACHE_SIZE:
                cache.popitem(last=False)
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
