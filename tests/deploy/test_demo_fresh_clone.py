"""`make demo` from a fresh clone: it installs only what the exporter needs at run time, in an environment of its
own, and serves the demo. The time from `make demo` to the first full scrape is printed (and quoted in the README);
what is asserted is what makes it fast: no torch, no test toolchain in that environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.constants import REPO
from tests.support.net import free_port

pytestmark = pytest.mark.e2e

INSTALL_AND_SERVE_S = 300  # a generous bound for a slow package index; the figure itself is printed


def stopped_in_time(make: subprocess.Popen[bytes], timeout_s: float = 30) -> bool:
    """Wait for the group to leave; one that does not is killed whole, so no demo outlives the test."""
    try:
        make.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(make.pid, signal.SIGKILL)
        make.wait(10)
        return False
    return True


def group_gone(pgid: int, timeout_s: float = 10) -> bool:
    """Nothing of the process group is left running (make may leave a moment before its child does)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_make_demo_from_a_fresh_clone_serves_with_only_the_runtime_dependencies(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    port = free_port()
    log = (tmp_path / "make-demo.log").open("wb")
    started = time.monotonic()
    make = subprocess.Popen(
        ["make", "demo", f"DEMO_ARGS=--web.listen-address 127.0.0.1:{port}"],
        cwd=clone,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # make and the demo it starts: stopped together, by the group's id
    )
    try:
        body = b""
        while b"model_local_kv_observed_bytes{" not in body:
            assert make.poll() is None, (tmp_path / "make-demo.log").read_text()
            assert time.monotonic() - started < INSTALL_AND_SERVE_S, "make demo did not serve in time"
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        print(f"make demo from a fresh clone: first full scrape after {time.monotonic() - started:.1f} s")
    finally:
        # make and the demo each get the group's SIGTERM, and make forwards its own to the demo: two signals close
        # together, in either order (tests/reliability/test_shutdown.py covers that race on its own).
        os.killpg(make.pid, signal.SIGTERM)
        stopped = stopped_in_time(make)
        log.close()
    assert stopped, "make demo did not stop within 30 s of SIGTERM:\n" + (tmp_path / "make-demo.log").read_text()
    assert group_gone(make.pid), "the demo outlived make"
    listed = subprocess.run(
        [str(clone / ".venv-demo/bin/python"), "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installed = {package["name"].lower().replace("_", "-") for package in json.loads(listed)}
    assert installed - {"pip", "setuptools"} == {"kv-exporter", "prometheus-client"}
    assert not (clone / ".venv").exists()  # the test toolchain (torch, transformers, ...) was never built
