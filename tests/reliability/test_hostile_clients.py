"""Hostile clients against the real `kv-exporter serve`: none of them, authenticated or not, may slow a scrape.
Each attack of issue 21 is a test here, with the bound the issue sets."""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import bcrypt

from tests.support.constants import SIMULATE_GPU
from tests.support.net import Headers, basic_authorization, get
from tests.support.raw_http import exchange
from tests.support.scrape import parse, pick
from tests.support.sidecar import Sidecar, sidecar

GET = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n"
REPEATED_HEADERS = GET + b"a:b\r\n" * 13_000 + b"\r\n"  # just under the 64 KiB head limit


def address(sc: Sidecar) -> tuple[str, int]:
    return "127.0.0.1", sc.port


def timed_get(
    sc: Sidecar, path: str = "/metrics", headers: Headers | None = None, timeout: float = 10.0
) -> tuple[int, Headers, bytes, float]:
    """One request on a fresh connection, and the seconds it took."""
    started = time.monotonic()
    status, answer_headers, body = sc.get(path, headers, timeout)
    return status, answer_headers, body, time.monotonic() - started


@contextmanager
def looping(clients: int, attack: Callable[[], object]) -> Iterator[None]:
    """`clients` threads each running `attack` in a loop until the block ends."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):  # a refused or reset attack is the server's right
                attack()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)  # the attack under way
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)


def test_repeated_header_lines_cost_no_scrape(tmp_path: Path) -> None:
    """Today's main: ~0.8 s of the connection loop per head (quadratic); 16 such clients kept /metrics from
    answering within 10 s."""
    assert len(REPEATED_HEADERS) < 64 << 10
    with sidecar(tmp_path, "--manifest-dir", str(tmp_path / "m"), *SIMULATE_GPU) as sc:
        started = time.monotonic()
        answer = exchange(address(sc), REPEATED_HEADERS)
        seconds = time.monotonic() - started
        assert answer.statuses == (200,) and seconds < 0.3, (answer, seconds)
        with looping(8, lambda: exchange(address(sc), REPEATED_HEADERS)):
            for path in ("/metrics", "/healthz") * 3:
                status, _, _, seconds = timed_get(sc, path)
                assert status == 200 and seconds < 1.0, (path, seconds)
        assert sc.stop() == 0


def test_wrong_passwords_do_not_hold_up_a_verified_scraper(tmp_path: Path) -> None:
    """Today's main: 200 clients with a wrong password made the cached scraper and /healthz wait 5-10 s or time
    out (every worker waited on the one bcrypt lock)."""
    hashed = bcrypt.hashpw(b"secret", bcrypt.gensalt(10)).decode()
    (tmp_path / "web.yml").write_text(f"basic_auth_users:\n  prometheus: {hashed}\n")
    good = {"Authorization": basic_authorization("prometheus", "secret")}
    args = ("--manifest-dir", str(tmp_path / "m"), *SIMULATE_GPU, "--web.config.file", str(tmp_path / "web.yml"))
    with sidecar(tmp_path, *args) as sc:
        assert sc.get(headers=good)[0] == 200  # verified once: cached from now on
        counter = iter(range(10**9))

        def wrong() -> None:
            get(sc.url + "/metrics", {"Authorization": basic_authorization("prometheus", f"x{next(counter)}")}, 60)

        with looping(200, wrong):
            for _ in range(3):
                status, _, _, seconds = timed_get(sc, headers=good, timeout=30)
                assert status == 200 and seconds < 5.0, seconds
                status, _, _, seconds = timed_get(sc, "/healthz", good, timeout=30)
                assert status == 200 and seconds < 1.0, seconds
        assert sc.stop() == 0


def test_a_connect_flood_at_the_cap_drops_no_scrape(tmp_path: Path) -> None:
    """Today's main at --web.max-connections 64: 1.5-5% of scrapes dropped, a newcomer evicting a connection whose
    request had arrived but was not read yet."""
    args = ("--manifest-dir", str(tmp_path / "m"), *SIMULATE_GPU, "--web.max-connections", "64")
    with sidecar(tmp_path, *args) as sc:

        def connect() -> None:
            held: collections.deque[socket.socket] = collections.deque()
            while len(held) < 50:  # connected as fast as one thread can, silent, each open for a while
                held.append(socket.create_connection(address(sc), timeout=5))
            for conn in held:
                conn.close()

        failures: list[str] = []
        with looping(8, connect):
            for _ in range(200):
                try:
                    status, _, _ = sc.get(timeout=10)
                    if status != 200:
                        failures.append(str(status))
                except OSError as exc:
                    failures.append(repr(exc))
        assert not failures, f"{len(failures)} of 200 scrapes failed: {failures[:5]}"
        assert sc.stop() == 0


def test_a_web_config_replaced_by_a_fifo_blocks_no_request(tmp_path: Path) -> None:
    """Today's main opened the web config with a blocking open: a FIFO in its place hung every request, /healthz
    too, for good."""
    config = tmp_path / "web.yml"
    config.write_text("http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    args = ("--manifest-dir", str(tmp_path / "m"), *SIMULATE_GPU, "--web.config.file", str(config))
    with sidecar(tmp_path, *args) as sc:
        assert sc.get()[0] == 200
        config.unlink()
        os.mkfifo(config)
        time.sleep(1.5)  # past the reload interval
        for path in ("/metrics", "/healthz", "/metrics"):
            status, headers, body, seconds = timed_get(sc, path)
            assert status == 200 and seconds < 1.0, (path, seconds)
            assert headers.get("X-Frame-Options") == "deny"  # the old config serves
        samples = parse(body.decode())
        assert pick(samples, "model_local_kv_web_config_last_reload_successful") == 0  # and says so
        assert "FIFO" in sc.log()
        config.unlink()
        config.write_text("http_server_config:\n  headers:\n    X-Frame-Options: sameorigin\n")
        deadline = time.monotonic() + 5.0  # the next check, within the interval, brings the new file in
        while (headers := sc.get(timeout=10)[1]).get("X-Frame-Options") != "sameorigin":
            assert time.monotonic() < deadline, headers
            time.sleep(0.2)
        status, headers, body = sc.get(timeout=10)
        assert status == 200 and headers.get("X-Frame-Options") == "sameorigin"
        assert pick(parse(body.decode()), "model_local_kv_web_config_last_reload_successful") == 1
        assert sc.stop() == 0
