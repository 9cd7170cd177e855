"""The exporter-toolkit web config, read strictly: every documented key, every refusal, basic auth, reloading.

TLS over real sockets is in test_webconfig_tls.py; the certificates come from test_webconfig_pki.py.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from pathlib import Path

import bcrypt
import pytest

import kv_exporter.web.reload as reload_module
from kv_exporter.web.auth import BCRYPT_MAX_PASSWORD_BYTES, parse_basic_authorization
from kv_exporter.web.config import ALLOWED_HEADERS, UNSUPPORTED, WebConfig, WebConfigError
from kv_exporter.web.reload import WebConfigReloader
from kv_exporter.web.tls import TLS_VERSIONS
from tests.support.net import basic_authorization
from tests.support.pki import PKI, make_pki, negotiable

# Cost 4 (bcrypt's minimum) keeps the tests fast; one test uses the toolkit's documented cost 10.
HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()


def write(folder: Path, text: str, name: str = "web.yml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def load(folder: Path, text: str) -> WebConfig:
    return WebConfig.load(write(folder, text))


def refused(folder: Path, text: str, match: str) -> WebConfigError:
    with pytest.raises(WebConfigError, match=match) as caught:
        load(folder, text)
    return caught.value


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_block(pki: PKI, extra: str = "") -> str:
    return f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n{extra}"


# -- what loads ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "---\n", "{}\n", "tls_server_config:\nhttp_server_config:\n"])
def test_an_empty_config_serves_plain_http_without_auth(tmp_path: Path, text: str) -> None:
    config = load(tmp_path, text)
    assert config.ssl_context() is None
    assert not config.auth_required
    assert config.check_auth(None)
    assert dict(config.headers) == {}


def test_every_documented_key_loads(tmp_path: Path, pki: PKI) -> None:
    config = load(
        tmp_path,
        f"""
tls_server_config:
  cert_file: {pki.server.cert}
  key_file: {pki.server.key}
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: {pki.ca.cert}
  client_allowed_sans: [scraper.example]
  min_version: TLS12
  max_version: TLS13
  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256]
  prefer_server_cipher_suites: false
http_server_config:
  http2: false
  headers:
    X-Frame-Options: deny
    Strict-Transport-Security: max-age=31536000; includeSubDomains
    X-Content-Type-Options: nosniff
    X-XSS-Protection: "1"
    Content-Security-Policy: "default-src 'self' *.test.example.net"
basic_auth_users:
  prometheus: {HASH}
""",
    )
    context = config.ssl_context()
    assert context is not None and config.tls is not None
    assert config.tls.client_auth_type == "RequireAndVerifyClientCert"
    assert config.tls.client_allowed_sans == ("scraper.example",)
    assert config.auth_required and config.http2 is False
    assert config.headers["X-Frame-Options"] == "deny"
    assert set(config.headers) == set(ALLOWED_HEADERS)
    assert config.watched_files() == (config.path, pki.server.cert, pki.server.key, pki.ca.cert)


def test_relative_file_names_are_relative_to_the_config_folder(tmp_path: Path, pki: PKI) -> None:
    config = load(pki.folder, "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    assert config.tls is not None and config.tls.cert_file == pki.server.cert
    assert config.ssl_context() is not None


def test_inline_pem_loads_without_touching_disk(tmp_path: Path, pki: PKI) -> None:
    def block(text: str) -> str:
        return "|\n" + "".join(f"    {line}\n" for line in text.splitlines())

    config = load(
        tmp_path,
        "tls_server_config:\n"
        f"  cert: {block(pki.server.cert.read_text())}"
        f"  key: {block(pki.server.key.read_text())}"
        f"  client_ca: {block(pki.ca.cert.read_text())}"
        "  client_auth_type: VerifyClientCertIfGiven\n",
    )
    assert config.ssl_context() is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["web.yml"]


def test_tls_is_on_only_when_a_certificate_or_client_policy_is_named(tmp_path: Path) -> None:
    # As the toolkit's TLSConfig.IsEnabled: versions alone do not turn TLS on.
    assert load(tmp_path, "tls_server_config:\n  min_version: TLS13\n").ssl_context() is None


# -- what is refused, with the toolkit's words where it has them ------------------------------------------------


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("tls_server_config:\n  cert_filse: server.crt\n", "unknown key 'cert_filse' in tls_server_config"),
        ("web_config: {}\n", "unknown key 'web_config'"),
        ("http_server_config:\n  header: {}\n", "unknown key 'header'"),
        ("basic_auth_users:\n  a: x\n  a: y\n", "duplicate key 'a'"),
        ("- a\n- b\n", "the document must be a mapping"),
        ("basic_auth_users: [a]\n", "basic_auth_users must be a mapping"),
        ("basic_auth_users:\n  john: doe\n", "not a bcrypt hash"),
        ("basic_auth_users:\n  1: x\n", "must be strings"),
        (f"basic_auth_users:\n  'a:b': {HASH}\n", "contains ':'"),
        ("http_server_config:\n  headers:\n    Content-Type: foo\n", 'HTTP header "Content-Type" can not be'),
        ("http_server_config:\n  headers:\n    x-frame-options: deny\n", "can not be configured"),
        ("http_server_config:\n  headers:\n    X-Frame-Options: allow\n", "invalid value for X-Frame-Options"),
        ("http_server_config:\n  headers:\n    X-Content-Type-Options: sniff\n", "invalid value"),
        ('http_server_config:\n  headers:\n    X-XSS-Protection: "1\\r\\nSet-Cookie: a=b"\n', "one-line"),
        ("http_server_config:\n  http2: yes please\n", "must be true or false"),
        ("rate_limit:\n  interval: 1s\n  burst: 5\n", "rate_limit is not supported"),
        ("tls_server_config: [cert_file]\n", "tls_server_config must be a mapping"),
        ("key: [unclosed\n", "invalid YAML"),
        ("a: &x [*x]\n", "invalid YAML: .*recursive"),
    ],
)
def test_refused_without_tls(tmp_path: Path, text: str, match: str) -> None:
    refused(tmp_path, text, match)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ("  client_ca_file: ca.crt\n", "client CA's have been configured without a Client Auth Policy"),
        ("  client_auth_type: Sometimes\n", "invalid ClientAuth: Sometimes"),
        ("  client_auth_type: RequestClientCert\n", "RequestClientCert is not supported"),
        ("  client_auth_type: RequireAnyClientCert\n", "RequireAnyClientCert is not supported"),
        ("  client_auth_type: RequireClientCert\n", "RequireClientCert is not supported"),
        ("  client_auth_type: VerifyClientCertIfGiven\n  client_allowed_sans: [a]\n", "client_allowed_sans needs"),
        ("  min_version: TLS14\n", "unknown TLS version: TLS14"),
        ("  min_version: TLS13\n  max_version: TLS12\n", "min_version is above max_version"),
        ("  cipher_suites: [TLS_INVENTED_CIPHER]\n", "unknown cipher: TLS_INVENTED_CIPHER"),
        ("  cipher_suites: [TLS_AES_128_GCM_SHA256]\n", "no TLS 1.2 suite"),
        ("  curve_preferences: [X25519]\n", "curve_preferences is not supported"),
        ("  cert: inline\n", "set cert or cert_file, not both"),
        ("  client_auth_type: 1\n", "client_auth_type must be a string"),
    ],
)
def test_refused_tls_settings(tmp_path: Path, pki: PKI, extra: str, match: str) -> None:
    refused(tmp_path, tls_block(pki, extra), match)


@pytest.mark.parametrize("version", ["TLS10", "TLS11", "TLS12", "TLS13"])
def test_a_tls_version_is_loaded_only_if_it_can_be_negotiated_here(tmp_path: Path, pki: PKI, version: str) -> None:
    """OpenSSL 3 takes `minimum_version = TLSv1` and then fails every TLS 1.0 handshake (security level 1 and up):
    such a version is refused at load, with the reason, rather than silently not honoured."""
    text = tls_block(pki, f"  min_version: {version}\n  max_version: {version}\n")
    if negotiable(pki, TLS_VERSIONS[version]):
        assert load(tmp_path, text).tls_enabled
    else:
        refused(tmp_path, text, f"{version} .*cannot be negotiated here .*security level")


def test_a_missing_certificate_or_key_is_named(tmp_path: Path, pki: PKI) -> None:
    refused(tmp_path, "tls_server_config:\n  key_file: server.key\n", "missing one of cert or cert_file")
    refused(tmp_path, f"tls_server_config:\n  cert_file: {pki.server.cert}\n", "missing one of key or key_file")
    error = refused(tmp_path, f"tls_server_config:\n  cert_file: nope.crt\n  key_file: {pki.server.key}\n", "nope")
    assert str(tmp_path / "nope.crt") in str(error)
    policy = f"  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {tmp_path}/absent-ca.crt\n"
    refused(tmp_path, tls_block(pki, policy), "client_ca_file not found: .*absent-ca.crt")


def test_a_key_that_does_not_match_the_certificate_is_refused(tmp_path: Path, pki: PKI) -> None:
    text = f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.client.key}\n"
    refused(tmp_path, text, "tls_server_config: .*(KEY_VALUES_MISMATCH|mismatch)")


def test_an_encrypted_key_is_refused_without_prompting(tmp_path: Path, pki: PKI) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.server.key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    # OpenSSL would read a passphrase from the terminal without the callback: stdin must stay untouched.
    refused(tmp_path, f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {encrypted}\n", "encrypted")


def test_every_unsupported_option_is_listed_with_a_reason() -> None:
    assert all(reason.strip() for reason in UNSUPPORTED.values())


def test_a_huge_file_is_refused_before_parsing(tmp_path: Path) -> None:
    refused(tmp_path, "#" * (2 << 20), "larger than")


def test_an_unreadable_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WebConfigError, match="cannot read"):
        WebConfig.load(tmp_path / "absent.yml")


# -- basic auth ---------------------------------------------------------------------------------------------------


@pytest.fixture
def users_config(tmp_path: Path) -> WebConfig:
    return load(tmp_path, f"basic_auth_users:\n  prometheus: {HASH}\n  ops: {HASH.replace('$2b$', '$2y$')}\n")


def test_right_password_passes_and_wrong_ones_do_not(users_config: WebConfig) -> None:
    assert users_config.check_auth(basic_authorization("prometheus", "s3cret"))
    assert users_config.check_auth(basic_authorization("ops", "s3cret"))  # htpasswd writes $2y$ hashes
    assert not users_config.check_auth(basic_authorization("prometheus", "s3cret "))
    assert not users_config.check_auth(basic_authorization("prometheus", ""))
    assert not users_config.check_auth(basic_authorization("nobody", "s3cret"))
    assert not users_config.check_auth(None)


@pytest.mark.parametrize(
    "header",
    [
        "",
        "Bearer abc",
        "Basic",
        "Basic ",
        "Basic not base64!",
        "Basic " + base64.b64encode(b"no-colon").decode(),
        "Basic " + base64.b64encode(b"prometheus:s3cret").decode()[:-2],  # bad padding
        "Basic " + base64.b64encode(b"\xff\xfe:s3cret").decode(),  # user not UTF-8
        "Basic " + base64.b64encode(b"prometheus:s3\x00cret").decode(),
        "Basic é",
    ],
)
def test_malformed_authorization_is_refused(users_config: WebConfig, header: str) -> None:
    assert not users_config.check_auth(header)


def test_the_scheme_is_case_insensitive_and_the_password_may_hold_colons(tmp_path: Path) -> None:
    config = load(tmp_path, f"basic_auth_users:\n  u: {bcrypt.hashpw(b'a:b', bcrypt.gensalt(4)).decode()}\n")
    assert config.check_auth("bAsIc " + base64.b64encode(b"u:a:b").decode())
    assert parse_basic_authorization("Basic " + base64.b64encode(b"u:a:b").decode()) == (b"u", b"a:b")


def test_successful_checks_are_cached_and_cost_one_bcrypt(tmp_path: Path) -> None:
    # The toolkit's documented cost (10): the first check pays bcrypt, repeats are served from the cache.
    slow_hash = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(10)).decode()
    config = load(tmp_path, f"basic_auth_users:\n  prometheus: {slow_hash}\n")
    auth = config._auth
    started = time.perf_counter()
    assert config.check_auth(basic_authorization("prometheus", "s3cret"))
    first = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(100):
        assert config.check_auth(basic_authorization("prometheus", "s3cret"))
    repeat = (time.perf_counter() - started) / 100
    assert auth.bcrypt_calls == 1
    assert repeat < first / 10, (first, repeat)
    assert not config.check_auth(basic_authorization("prometheus", "wrong"))
    assert auth.bcrypt_calls == 2  # a different password is a new bcrypt check


def test_the_cache_is_bounded(users_config: WebConfig) -> None:
    good = basic_authorization("prometheus", "s3cret")
    assert users_config.check_auth(good)
    for i in range(300):
        users_config.check_auth(basic_authorization("prometheus", f"guess-{i}"))
    assert len(users_config._auth._refusals) <= 100
    assert users_config.known_auth(good) is True  # wrong guesses never push a verified credential out
    assert users_config.known_auth(basic_authorization("prometheus", "never-tried")) is None  # would need bcrypt


def test_passwords_longer_than_72_bytes_follow_bcrypt(tmp_path: Path) -> None:
    long_password = "x" * BCRYPT_MAX_PASSWORD_BYTES
    config = load(
        tmp_path, f"basic_auth_users:\n  u: {bcrypt.hashpw(long_password.encode(), bcrypt.gensalt(4)).decode()}\n"
    )
    assert config.check_auth(basic_authorization("u", long_password))
    assert config.check_auth(basic_authorization("u", long_password + "ignored"))  # bcrypt reads only 72 bytes
    assert not config.check_auth(basic_authorization("u", long_password[:-1]))


def test_unknown_users_pay_bcrypt_too(users_config: WebConfig) -> None:
    # Without the dummy hash an unknown user would answer instantly and give away which users exist.
    before = users_config._auth.bcrypt_calls
    assert not users_config.check_auth(basic_authorization("nobody", "x"))
    assert users_config._auth.bcrypt_calls == before + 1


# -- reloading ----------------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def replace(path: Path, text: str) -> None:
    """Atomic replace (new inode), as editors and Kubernetes secret updates do."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_changed_file_is_reread_at_most_once_per_interval(tmp_path: Path) -> None:
    path = write(tmp_path, f"basic_auth_users:\n  a: {HASH}\n")
    clock = FakeClock()
    reloader = WebConfigReloader(path, interval=1.0, clock=clock)
    first = reloader.current()
    replace(path, f"basic_auth_users:\n  b: {HASH}\n")
    clock.now += 0.5
    assert reloader.current() is first  # not checked yet
    clock.now += 0.6
    second = reloader.current()
    assert second is not first and reloader.reloads == 1
    assert second.check_auth(basic_authorization("b", "s3cret"))
    assert not second.check_auth(basic_authorization("a", "s3cret"))
    clock.now += 5
    assert reloader.current() is second  # unchanged file: no reload


@pytest.fixture
def edited_with_held_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[WebConfigReloader, threading.Event]:
    """A reloader past its interval after an edit, whose next check reads the file only once the event is set."""
    path = write(tmp_path, f"basic_auth_users:\n  a: {HASH}\n")
    clock = FakeClock()
    reloader = WebConfigReloader(path, interval=1.0, clock=clock)
    released = threading.Event()
    load = reload_module._load_with_fingerprint

    def held_load(config_path: Path) -> tuple[WebConfig, object]:
        released.wait(10)
        return load(config_path)

    monkeypatch.setattr(reload_module, "_load_with_fingerprint", held_load)
    replace(path, f"basic_auth_users:\n  b: {HASH}\n")
    clock.now += 2
    return reloader, released


def test_a_check_started_by_a_caller_that_cannot_wait_is_waited_for_by_the_next(
    edited_with_held_check: tuple[WebConfigReloader, threading.Event],
) -> None:
    """The server's loop starts the check without waiting; the scrape it hands on must answer for the new file,
    not for the one before it, even on a loaded machine where the check is still running."""
    reloader, released = edited_with_held_check
    first = reloader.current(wait_s=0)  # the loop: check started, not waited for
    assert first.check_auth(basic_authorization("a", "s3cret"))
    threading.Timer(0.05, released.set).start()
    assert reloader.current().check_auth(basic_authorization("b", "s3cret"))
    assert reloader.reloads == 1


def test_a_stuck_check_holds_only_the_requests_in_its_first_wait(
    edited_with_held_check: tuple[WebConfigReloader, threading.Event],
) -> None:
    reloader, released = edited_with_held_check
    began = time.monotonic()
    reloader.current(wait_s=1.0)
    assert time.monotonic() - began >= 1.0  # the check began with this request: waited for, up to the wait
    began = time.monotonic()
    reloader.current(wait_s=1.0)
    assert time.monotonic() - began < 0.5  # the same check, past its first second: the config in force at once
    released.set()


def test_an_invalid_new_file_keeps_the_last_good_config_and_logs_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, f"basic_auth_users:\n  a: {HASH}\n")
    clock = FakeClock()
    reloader = WebConfigReloader(path, interval=1.0, clock=clock)
    good = reloader.current()
    replace(path, "basic_auth_users:\n  a: not-a-hash\n")
    with caplog.at_level(logging.ERROR, logger="kv_exporter.web.config"):
        for _ in range(5):
            clock.now += 2
            assert reloader.current() is good
    assert len([r for r in caplog.records if "not reloaded" in r.getMessage()]) == 1
    assert not reloader.last_reload_ok and "not a bcrypt hash" in (reloader.last_error or "")
    assert reloader.reload_failures == 1
    replace(path, f"basic_auth_users:\n  c: {HASH}\n")
    clock.now += 2
    assert reloader.current().check_auth(basic_authorization("c", "s3cret"))
    assert reloader.last_reload_ok


def test_a_rotated_certificate_reloads_without_touching_the_config(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    path = write(tmp_path, tls_block(pki))
    clock = FakeClock()
    reloader = WebConfigReloader(path, interval=1.0, clock=clock)
    first = reloader.current()
    rotated = make_pki(tmp_path / "pki2")
    os.replace(rotated.server.cert, pki.server.cert)
    os.replace(rotated.server.key, pki.server.key)
    clock.now += 2
    assert reloader.current() is not first and reloader.reloads == 1


def test_turning_tls_on_needs_a_restart(tmp_path: Path, pki: PKI) -> None:
    path = write(tmp_path, "")
    clock = FakeClock()
    reloader = WebConfigReloader(path, interval=1.0, clock=clock)
    replace(path, tls_block(pki))
    clock.now += 2
    assert reloader.current().ssl_context() is None
    assert "needs a restart" in (reloader.last_error or "")


def test_an_invalid_file_at_start_up_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(WebConfigError, match="unknown key"):
        WebConfigReloader(write(tmp_path, "nonsense: 1\n"))


def test_a_deleted_file_keeps_the_last_good_config(tmp_path: Path) -> None:
    path = write(tmp_path, f"basic_auth_users:\n  a: {HASH}\n")
    clock = FakeClock()
    reloader = WebConfigReloader(path, interval=1.0, clock=clock)
    good = reloader.current()
    path.unlink()
    clock.now += 2
    assert reloader.current() is good
    assert "cannot read" in (reloader.last_error or "")
