"""One request or one connection must not blind the sidecar process: a body read as a second request, a malformed
head, a write without credentials, a thousand idle or trickling connections, a collection stuck in NVML, a TLS
version the platform will not speak. Each test drives the real `kv-exporter serve` with raw bytes
(`tests.support.raw_http`), and a normal scrape still answers around each fault."""

from __future__ import annotations

import re
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import bcrypt
import pytest

from kv_exporter.sidecar.simulated_engine import SimulatedEngine, vllm_page
from kv_exporter.transport.connection import DEFAULT_MAX_CONNECTIONS, Limits
from tests.support.constants import REPO, SIMULATE_GPU
from tests.support.fake_nvml import hanging_nvml
from tests.support.net import basic_authorization, get
from tests.support.pki import client_context, make_pki, negotiable
from tests.support.raw_http import Exchange, closed_within, exchange
from tests.support.sidecar import Sidecar, sidecar, with_prelude

GET = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n"
SMUGGLED = b"GET /nope HTTP/1.1\r\nHost: localhost\r\n\r\n"  # a 404 if it were ever read as a request
HEAD_DEADLINE_S = Limits().head_timeout_s


def serve_empty(tmp_path: Path, *args: str, **options: Any) -> AbstractContextManager[Sidecar]:
    """The sidecar with an empty manifest folder and a simulated GPU: only HTTP is under test."""
    return sidecar(tmp_path, "--manifest-dir", str(tmp_path / "m"), *SIMULATE_GPU, *args, **options)


def address(sc: Sidecar) -> tuple[str, int]:
    return "127.0.0.1", sc.port


def thread_count(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.MULTILINE)[1])  # type: ignore[index]


def test_a_request_body_is_never_read_as_a_second_request(tmp_path: Path) -> None:
    with serve_empty(tmp_path) as sc:
        framed = GET + b"Content-Length: %d\r\n\r\n" % len(SMUGGLED) + SMUGGLED
        assert exchange(address(sc), framed) == Exchange((200,), False)  # dropped; the connection goes on
        chunked = GET + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(SMUGGLED) + SMUGGLED + b"\r\n0\r\n\r\n"
        assert exchange(address(sc), chunked) == Exchange((200,), True)  # never decoded: closed instead
        too_large = GET + b"Content-Length: 1000000\r\n\r\n" + SMUGGLED
        assert exchange(address(sc), too_large) == Exchange((200,), True)  # left unread: closed instead
        waiting = GET + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(SMUGGLED)
        assert exchange(address(sc), waiting + SMUGGLED) == Exchange((200,), True)
        assert sc.stop() == 0


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        pytest.param(GET + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, id="cl_and_te"),
        pytest.param(GET + b"Broken header\r\n\r\n", 400, id="no_colon"),
        pytest.param(GET + b"Host: other\r\n\r\n", 400, id="duplicate_host"),
        pytest.param(b"GET /metrics\r\n\r\n", 400, id="http_0_9"),
        pytest.param(b"GET /metrics HTTP/x\r\nHost: localhost\r\n\r\n", 400, id="malformed_version"),
        pytest.param(b"GET /metrics HTTP/0.9\r\nHost: localhost\r\n\r\n", 505, id="version_0_9"),
        pytest.param(b"GET /metrics HTTP/2.0\r\nHost: localhost\r\n\r\n", 505, id="version_2_0"),
        pytest.param(GET + b"Transfer-Encoding: gzip\r\n\r\n", 501, id="unknown_transfer_encoding"),
    ],
)
def test_a_malformed_request_gets_go_s_answer_and_a_close(tmp_path: Path, raw: bytes, status: int) -> None:
    """Go answers 400 for what it cannot parse, 505 for a well-formed version other than 1.x, and 501 for a
    transfer coding it does not know; each time the connection closes (tests/reliability/test_node_exporter_parity.py
    compares these with node_exporter)."""
    with serve_empty(tmp_path) as sc:
        assert exchange(address(sc), raw) == Exchange((status,), True)
        assert sc.get()[0] == 200
        assert sc.stop() == 0


def test_authentication_comes_before_the_method(tmp_path: Path) -> None:
    hashed = bcrypt.hashpw(b"secret", bcrypt.gensalt(4)).decode()
    (tmp_path / "web.yml").write_text(f"basic_auth_users:\n  prometheus: {hashed}\n")
    with serve_empty(tmp_path, "--web.config.file", str(tmp_path / "web.yml")) as sc:
        credentials = f"Authorization: {basic_authorization('prometheus', 'secret')}\r\n".encode()
        for method in (b"GET", b"POST", b"DELETE", b"OPTIONS"):
            request = method + b" /metrics HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n"
            assert exchange(address(sc), request + b"\r\n").statuses == (401,), method
            expected = 200 if method == b"GET" else 405
            assert exchange(address(sc), request + credentials + b"\r\n").statuses == (expected,), method
        assert sc.stop() == 0


def test_a_thousand_idle_and_trickling_connections_pin_no_threads(tmp_path: Path) -> None:
    with serve_empty(tmp_path) as sc:
        assert sc.get()[0] == 200
        before_kib, before_threads = sc.rss_kib(), thread_count(sc.pid)
        held: list[socket.socket] = []
        try:
            for n in range(1000):
                conn = socket.create_connection(address(sc), timeout=10)
                if n % 2:
                    conn.sendall(GET[: n % len(GET)])  # a head begun, never finished
                held.append(conn)
            started = time.monotonic()
            status, _, body = sc.get(timeout=30)
            answered_s = time.monotonic() - started
            during_kib, during_threads = sc.rss_kib(), thread_count(sc.pid)
            dropped = sum(closed_within(conn, 0.001) is not None for conn in held)
        finally:
            for conn in held:
                conn.close()
        time.sleep(1.0)
        after_kib = sc.rss_kib()
        assert sc.stop() == 0
    print(
        f"\n1000 connections: a scrape answered in {answered_s * 1000:.0f} ms; threads {before_threads} -> "
        f"{during_threads}; {dropped} of ours dropped at the cap; RSS {before_kib / 1024:.1f} MiB -> "
        f"{during_kib / 1024:.1f} MiB held -> {after_kib / 1024:.1f} MiB after"
    )
    assert status == 200 and b"model_local_kv_" in body
    assert answered_s < 5.0
    assert during_threads < 20  # one per connection was 1,000
    assert dropped >= 1000 + 1 - DEFAULT_MAX_CONNECTIONS  # at --web.max-connections the longest-waiting made room
    assert after_kib - before_kib < 8 * 1024


def test_a_silent_or_trickling_client_is_cut_off_at_the_head_deadline(tmp_path: Path) -> None:
    with serve_empty(tmp_path) as sc:
        silent = socket.create_connection(address(sc), timeout=10)
        trickling = socket.create_connection(address(sc), timeout=10)
        started = time.monotonic()
        stop = threading.Event()

        def trickle() -> None:
            for byte in (GET + b"X: " + b"a" * 1000).decode():
                if stop.wait(0.25):
                    return
                try:
                    trickling.sendall(byte.encode())
                except OSError:
                    return

        sender = threading.Thread(target=trickle)
        sender.start()
        try:
            assert sc.get()[0] == 200  # others are served meanwhile
            closed_after = closing_times([silent, trickling], started, within_s=HEAD_DEADLINE_S + 10)
        finally:
            stop.set()
            sender.join()
            silent.close()
            trickling.close()
        assert sc.stop() == 0
    assert len(closed_after) == 2, closed_after
    for waited in closed_after.values():
        assert HEAD_DEADLINE_S - 0.5 < waited < HEAD_DEADLINE_S + 3, closed_after


def closing_times(socks: list[socket.socket], since: float, within_s: float) -> dict[int, float]:
    """Seconds from `since` until the server closed each socket (by index), for those it closed in time."""
    closed: dict[int, float] = {}
    while len(closed) < len(socks) and (left := since + within_s - time.monotonic()) > 0:
        open_ones = [sock for n, sock in enumerate(socks) if n not in closed]
        for sock in select.select(open_ones, [], [], left)[0]:
            try:
                ended = not sock.recv(65536)
            except ConnectionError:
                ended = True
            if ended:
                closed[socks.index(sock)] = time.monotonic() - since
    return closed


def test_a_client_gone_before_its_answer_is_no_error(tmp_path: Path) -> None:
    """Prometheus closes a scrape's connection at its scrape_timeout; the answer written after that is reset by the
    client's kernel, and shutting our side then failed with ENOTCONN, logged as an error in an asyncio callback
    (seen in a real chain under load). A client gone is a normal end: nothing logged past debug."""
    engine = SimulatedEngine(vllm_page("m", 1), fault="slow", delay_s=0.2)
    with engine, serve_empty(tmp_path, "--engine-url", engine.url) as sc:
        for _ in range(5):
            with socket.create_connection(address(sc)) as client:
                client.sendall(GET + b"Connection: close\r\n\r\n")
            time.sleep(0.3)  # the answer, written after the close
        assert get(sc.url + "/metrics", timeout=10)[0] == 200
        assert sc.stop() == 0
        assert "level=error" not in sc.log(), sc.log()[-2000:]


def test_healthz_fails_while_a_collection_is_stuck_and_recovers(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    args = ("--manifest-dir", str(tmp_path / "m"), "--engine-timeout", "1", "--collection-timeout", "3")
    with sidecar(tmp_path, *args, entry=with_prelude(hanging_nvml(hold))) as sc:
        assert sc.get("/healthz")[0] == 200 and sc.get()[0] == 200
        hold.touch()  # NVML hangs from the next collection on
        stuck: list[tuple[int, float]] = []
        started = time.monotonic()
        scraper = threading.Thread(target=lambda: stuck.append((sc.get(timeout=60)[0], time.monotonic() - started)))
        scraper.start()
        health = poll_health(sc, 503, within_s=30)
        failing_after = time.monotonic() - started
        deadline = float(re.search(rb"past its ([\d.]+) s deadline", health)[1])  # type: ignore[index]
        scraper.join(30)
        quick = time.monotonic()
        assert sc.get()[0] == 503 and time.monotonic() - quick < 2  # no waiting on the stuck one
        hold.unlink()
        poll_health(sc, 200, within_s=10)
        assert sc.get()[0] == 200
        assert sc.stop() == 0
    assert deadline - 0.5 < failing_after < deadline + 3  # 200 until the collection deadline, 503 from then on
    [(status, answered_s)] = stuck
    assert status == 503 and answered_s < deadline + 3  # the scrape that met the stuck collection did not hang


def poll_health(sc: Sidecar, status: int, within_s: float) -> bytes:
    deadline = time.monotonic() + within_s
    while True:
        got, _, body = sc.get("/healthz", timeout=10)
        if got == status:
            return body
        assert time.monotonic() < deadline, (got, body)
        time.sleep(0.1)


def test_a_tls_version_the_platform_refuses_is_refused_at_start(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n"
                      "  min_version: TLS10\n")  # fmt: skip
    if negotiable(pki, ssl.TLSVersion.TLSv1):  # an OpenSSL that still speaks TLS 1.0: then it must be honoured
        context = client_context(pki)
        context.maximum_version = ssl.TLSVersion.TLSv1
        context.set_ciphers("ALL:@SECLEVEL=0")
        with serve_empty(tmp_path, "--web.config.file", str(config)) as sc:
            assert get(f"https://127.0.0.1:{sc.port}/metrics", context=context)[0] == 200
            assert sc.stop() == 0
        return
    argv = [sys.executable, "-m", "kv_exporter", "serve", "--web.listen-address", "127.0.0.1:0",
            "--manifest-dir", str(tmp_path / "m"), "--web.config.file", str(config)]  # fmt: skip
    with subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as process:
        try:
            output, _ = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            raise AssertionError("started and served with min_version: TLS10, which no client can use") from None
    assert process.returncode == 1, output
    assert b"TLS10" in output and b"cannot be negotiated" in output, output
