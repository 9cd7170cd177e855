"""The real sidecar as operators run it: `python -m kv_exporter serve ...` (or `demo`) in a process of its own,
stopped by its pid.

It listens on 127.0.0.1:0 and announces its URL in its output, which goes to a file (a pipe nobody reads would
block a chatty sidecar); `start_sidecar` returns once it has.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.constants import REPO, SIMULATE_GPU
from tests.support.net import Headers, get
from tests.support.scrape import Samples, parse

ENTRY = ("-m", "kv_exporter")
# `serve` logs "serving URL/<telemetry path> (...)", `demo` prints "landing page: URL/" first.
ANNOUNCED_URL = re.compile(r"(http://127\.0\.0\.1:\d+)/")
STOP_TIMEOUT_S = 15.0
# Root is not bound by permission bits: without these two capabilities it is, while still reaching its own checkout
# (which may sit in a 0700 folder no other user can enter).
DROP_FILE_CAPABILITIES = ("setpriv", "--bounding-set=-dac_override,-dac_read_search")
_logs = itertools.count()


def stop_process(process: subprocess.Popen[Any], sig: int = signal.SIGTERM, grace_s: float = 10.0) -> int | None:
    """Signal a process we started, by its pid, and wait `grace_s`; then SIGKILL it. Its exit status, or None when
    it had to be killed."""
    if process.poll() is None:
        os.kill(process.pid, sig)
    try:
        return process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        return None


def serve_args(folder: Path) -> tuple[str, ...]:
    """`serve` on the manifest folder `folder`, with a simulated GPU and no engine page: the usual fault test."""
    return ("--manifest-dir", str(folder), *SIMULATE_GPU)


def with_prelude(code: str) -> tuple[str, ...]:
    """An entry point that runs `code` in the sidecar process before its command line (e.g. to hide a module)."""
    return ("-c", f"{code}\nimport sys\nfrom kv_exporter.sidecar.cli import main\nsys.exit(main(sys.argv[1:]))")


@dataclass
class Sidecar:
    process: subprocess.Popen[bytes]
    url: str  # http://127.0.0.1:PORT
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def port(self) -> int:
        return int(urllib.parse.urlsplit(self.url).port or 0)

    @property
    def address(self) -> str:
        """host:port, as Prometheus names a target."""
        return urllib.parse.urlsplit(self.url).netloc

    def get(
        self, path: str = "/metrics", headers: Headers | None = None, timeout: float = 30.0
    ) -> tuple[int, Headers, bytes]:
        """One request on a fresh connection; any transport error propagates (the tests count it as a failure)."""
        return get(self.url + path, headers, timeout)

    def text(self, headers: Headers | None = None) -> str:
        """A scrape that must answer 200; a transport error fails with the sidecar's state and the end of its log."""
        try:
            status, _, body = self.get(headers=headers)
        except OSError as exc:
            raise AssertionError(f"{exc!r} from {self.described()}") from exc
        assert status == 200, (status, body[:200])
        return body.decode()

    def described(self) -> str:
        code = self.process.poll()
        state = "running" if code is None else f"exited with {code}"
        return f"sidecar {self.pid} ({state}), its log ending:\n{self.log()[-3000:]}"

    def samples(self, headers: Headers | None = None) -> Samples:
        return parse(self.text(headers))

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Signal it and wait; its exit status. One that does not stop in time is killed and the test fails."""
        code = stop_process(self.process, sig, timeout)
        if code is None:
            raise AssertionError(f"sidecar {self.pid} ignored signal {sig} for {timeout} s")
        return code


def start_sidecar(
    workdir: Path,
    *args: str,
    command: str = "serve",
    entry: Sequence[str] = ENTRY,
    cwd: Path = REPO,
    env: Mapping[str, str] | None = None,
    permission_bits: bool = False,
    timeout_s: float = 30.0,
) -> Sidecar:
    """Start `python ENTRY COMMAND --web.listen-address 127.0.0.1:0 ARGS` in `cwd`; return it once it serves.

    `entry`: what runs instead of `-m kv_exporter` (another module's main, or `with_prelude`). `permission_bits`:
    make file permissions apply to it when we are root (anyone else is bound by them already and runs it as is).
    Its output goes to WORKDIR/sidecar-N.log.
    """
    log_path = workdir / f"sidecar-{next(_logs)}.log"
    argv = [sys.executable, *entry, command, "--web.listen-address", "127.0.0.1:0", *args]
    if permission_bits and os.geteuid() == 0:
        argv = [*DROP_FILE_CAPABILITIES, *argv]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        match = ANNOUNCED_URL.search(log_path.read_text(errors="replace"))
        if match:
            return Sidecar(process, match.group(1), log_path)
        time.sleep(0.05)
    code = stop_process(process)
    raise AssertionError(f"sidecar did not start (exit {code}):\n{log_path.read_text(errors='replace')}")


def run_command(*args: str, cwd: Path = REPO, timeout_s: float = 60.0) -> subprocess.CompletedProcess[bytes]:
    """`python -m kv_exporter ARGS` (a command that exits, e.g. `report`) in `cwd`, as the sidecar is started: its
    exit status and its output as bytes, undecoded (whether it is text is for the test to check)."""
    return subprocess.run([sys.executable, *ENTRY, *args], cwd=cwd, capture_output=True, timeout=timeout_s, check=False)


@contextmanager
def sidecar(workdir: Path, *args: str, **options: Any) -> Iterator[Sidecar]:
    """`start_sidecar`, stopped by its pid when the block ends (a test may stop it first, to check its exit)."""
    started = start_sidecar(workdir, *args, **options)
    try:
        yield started
    finally:
        if started.process.poll() is None:
            started.stop()
