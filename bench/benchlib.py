"""Shared by every benchmark: statistics, the printed report, result files, child processes, the HTTP scraper.

Every figure a benchmark prints goes through `Report`, every claim through `Check`, so `bench.run_all` can collect
them into one table. Child processes are started with `start` (or adopted with `track`) and stopped by pid with
`stop` (also when a benchmark fails half-way: use `children()` as a context manager). The benchmarks run as modules
from the repository root (`python -m bench.run_all`), and so do their helper processes (`module_argv`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.support.constants import REPO
from tests.support.sidecar import stop_process

PYTHON = sys.executable

# What Prometheus 2.42 (the Debian package used by the e2e tests) sends with every scrape, as captured from it
# (the timeout header at the default scrape_timeout).
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip",
    "User-Agent": "Prometheus/2.42.0+ds",
    "X-Prometheus-Scrape-Timeout-Seconds": "10",
}


def module_argv(module: str, *args: str) -> list[str]:
    """The command line of `python -m bench.MODULE ARGS` (run in the repository root: see `Children.start`)."""
    return [PYTHON, "-m", f"bench.{module}", *args]


# -- statistics ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    n: int
    median: float
    p90: float
    p99: float
    min: float
    max: float


def percentile(ordered: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of sorted samples (no interpolation: a p99 is a sample that happened)."""
    rank = max(1, -(-len(ordered) * p // 100))  # ceil(n * p / 100)
    return ordered[int(rank) - 1]


def summarize(samples: Sequence[float]) -> Stats:
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    return Stats(
        len(ordered),
        statistics.median(ordered),
        percentile(ordered, 90),
        percentile(ordered, 99),
        ordered[0],
        ordered[-1],
    )


# -- the printed report and the result file -------------------------------------------------------------------


@dataclass
class Check:
    """One target: what it asks, what was measured, and whether it holds."""

    target: str
    measured: str
    ok: bool


@dataclass
class Report:
    """What one benchmark prints, and writes as JSON for bench.run_all (`--json-out`)."""

    name: str
    method: str
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    def start(self) -> None:
        print(f"\n== {self.name} ==", flush=True)
        for line in self.method.strip().splitlines():
            print(f"  method: {line.strip()}" if line.strip() else "", flush=True)
        self.note("load average at start (2 cores)", load_average())

    def finish(self, json_out: str | None) -> None:
        self.note("load average at end (2 cores)", load_average())
        self.write(json_out)

    def stats(self, label: str, stats: Stats, unit: str = "ms") -> None:
        self.figures[label] = asdict(stats) | {"unit": unit}
        print(f"  {label:<44} {format_stats(stats, unit)}", flush=True)

    def ratio(self, label: str, ours: float, baseline: float) -> float:
        value = ours / baseline if baseline else float("inf")
        self.figures[f"ratio: {label}"] = value
        print(f"  ratio {label:<38} {value:8.2f}x", flush=True)
        return value

    def note(self, label: str, value: Any) -> None:
        self.figures[label] = value
        print(f"  {label:<44} {value}", flush=True)

    def check(self, target: str, measured: str, ok: bool) -> bool:
        self.checks.append(Check(target, measured, ok))
        print(f"  [{'PASS' if ok else 'MISS'}] {target}: {measured}", flush=True)
        return ok

    def write(self, path: str | None) -> None:
        if path:
            checks = [asdict(c) for c in self.checks]
            data = {"name": self.name, "method": self.method, "figures": self.figures, "checks": checks}
            Path(path).write_text(json.dumps(data, indent=2, default=str))


def format_stats(stats: Stats, unit: str = "ms") -> str:
    def f(value: float) -> str:
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"

    return (
        f"n={stats.n:<6} median {f(stats.median)} {unit}  p90 {f(stats.p90)}  p99 {f(stats.p99)}  "
        f"min-max {f(stats.min)}-{f(stats.max)}"
    )


def json_out_arg(argv: Sequence[str] | None = None) -> str | None:
    """`--json-out PATH`, the one option every benchmark takes (bench.run_all passes it)."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--json-out")
    return parser.parse_known_args(argv)[0].json_out  # type: ignore[no-any-return]


# -- child processes -------------------------------------------------------------------------------------------


class Children:
    """Processes this benchmark started; every one is stopped by its pid on exit, whatever happened."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Popen in the repository root (where `python -m bench.X` finds the benchmarks), unless `cwd` says else."""
        return self.track(subprocess.Popen(list(argv), **{"cwd": REPO, **kwargs}))

    def track(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        """Stop `proc`, started elsewhere, with the others."""
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
        stop_process(proc, grace_s=grace_s)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)


@contextlib.contextmanager
def children() -> Iterator[Children]:
    kids = Children()
    try:
        yield kids
    finally:
        kids.stop_all()


def read_json_line(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> Any:
    """The first line a helper process prints (its ports, its pid), as JSON; fails if it dies first."""
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), True)
    deadline = time.monotonic() + timeout_s
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(0.1):
                line = proc.stdout.readline()
                if not line:
                    break
                return json.loads(line)
            if proc.poll() is not None:
                break
    raise RuntimeError(f"helper process {proc.args!r} gave no ready line (exit {proc.poll()})")


def rss_bytes(pid: int) -> int:
    """Resident set size of a live process, from /proc (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a live process has used (all its threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_average() -> str:
    """The 1-minute load average: other work on this shared machine inflates every wall-clock figure."""
    return Path("/proc/loadavg").read_text().split()[0]


def mapped_files(pid: int) -> set[str]:
    """Every file a process has mapped (shared libraries included)."""
    found = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            found.add(parts[5])
    return found


# -- the scraper -----------------------------------------------------------------------------------------------


class ScrapeError(RuntimeError):
    pass


class Scraper:
    """One Prometheus-like client: a keep-alive connection, Prometheus' headers, the whole body read."""

    def __init__(self, host: str, port: int, path: str = "/metrics", timeout_s: float = 30.0) -> None:
        self.host, self.port, self.path, self.timeout_s = host, port, path, timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def scrape(self) -> tuple[float, bytes, dict[str, str]]:
        """Seconds from sending the request to the last body byte, the body, the headers; raises ScrapeError."""
        for attempt in (1, 2):  # a keep-alive connection the server closed is reopened once
            conn = self._conn or http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            self._conn = conn
            started = time.perf_counter()
            try:
                conn.request("GET", self.path, headers=PROMETHEUS_HEADERS)
                response = conn.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if attempt == 2:
                    raise ScrapeError(f"{type(exc).__name__}: {exc}") from exc
                continue
            elapsed = time.perf_counter() - started
            if response.status != 200:
                raise ScrapeError(f"HTTP {response.status}")
            return elapsed, body, dict(response.getheaders())
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def decoded(body: bytes, headers: dict[str, str]) -> str:
    import gzip

    return (gzip.decompress(body) if headers.get("Content-Encoding") == "gzip" else body).decode()


def scrape_series(host: str, port: int, count: int) -> list[float]:
    """`count` sequential scrapes on one connection, in milliseconds."""
    scraper = Scraper(host, port)
    try:
        return [scraper.scrape()[0] * 1000 for _ in range(count)]
    finally:
        scraper.close()


def wait_until_serving(host: str, port: int, timeout_s: float = 30.0, path: str = "/metrics") -> float:
    """Poll until `path` answers 200; returns the perf_counter time it first did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection(host, port, timeout=max(1.0, deadline - time.monotonic()))
            conn.request("GET", path, headers=PROMETHEUS_HEADERS)
            response = conn.getresponse()
            response.read()
            conn.close()
            if response.status == 200:
                return time.perf_counter()
        except OSError:
            pass
        time.sleep(0.002)
    raise RuntimeError(f"nothing served http://{host}:{port}{path} within {timeout_s} s")


@dataclass
class Subject:
    """A server under test: its process (for CPU accounting) and a scraper on it."""

    pid: int
    scraper: Scraper
    samples: list[float] = field(default_factory=list)  # ms
    cpu_s: float = 0.0  # the server's CPU time spent during the counted scrapes


def interleaved(subjects: dict[str, Subject], per_subject: int, block: int = 100, rewarm: int = 1) -> None:
    """Scrape each subject `per_subject` more times, alternating in blocks so that load from other work on the
    machine falls on all of them alike rather than on whichever ran last; accounts each server's CPU time.

    The first `rewarm` scrapes of each block are not counted: a process that sat idle while the others were
    scraped answers its first request late on this VM (+8-20 ms after 1-3 s idle, baseline alike; measured by
    `idle_gaps`), which would charge a wake-up to whichever subject idled longest.
    """
    target = {name: len(subject.samples) + per_subject for name, subject in subjects.items()}
    while any(len(subject.samples) < target[name] for name, subject in subjects.items()):
        for name, subject in subjects.items():
            todo = min(block, target[name] - len(subject.samples))
            for _ in range(rewarm if todo else 0):
                subject.scraper.scrape()
            before = cpu_seconds(subject.pid)
            subject.samples.extend(subject.scraper.scrape()[0] * 1000 for _ in range(todo))
            subject.cpu_s += cpu_seconds(subject.pid) - before


def idle_gaps(subjects: dict[str, Subject], gap_s: float, count: int) -> dict[str, list[float]]:
    """The first scrape after `gap_s` of idleness, `count` times per subject (ms): what a Prometheus scraping
    every 15 s sees, as opposed to the back-to-back steady state."""
    found: dict[str, list[float]] = {name: [] for name in subjects}
    for _ in range(count):
        for name, subject in subjects.items():
            time.sleep(gap_s)
            found[name].append(subject.scraper.scrape()[0] * 1000)
    return found
