"""What the real-engine tests share about a running OpenAI-compatible server (vLLM or vllm-omni) and /proc."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest


def mark_real_engine_tests(
    items: list[pytest.Item], folder: Path, marker: pytest.MarkDecorator, ready: bool, missing: str
) -> None:
    """Mark the tests under `folder`; skip them, saying `missing`, where their engine environment is not built."""
    for item in items:
        if folder in Path(str(item.fspath)).parents:
            item.add_marker(marker)
            if not ready:
                item.add_marker(pytest.mark.skip(reason=missing))


def stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (after the command name, which may hold spaces), or None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def parent_pid(pid: int) -> int:
    fields = stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    return int(fields[1])


COMPLETIONS_PATH = "/v1/completions"


class OpenAIServer:
    """Client side of a server process started by a test; the concrete dataclass supplies these fields."""

    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    manifest_dir: Path
    report_dir: Path
    started_at: float
    kind = "server"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def while_waiting(self) -> None:
        """Called on every poll of wait_ready (e.g. to note the process tree while it grows)."""

    def wait_ready(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.while_waiting()
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}:\n{self.log()[-6000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url("/health"), timeout=2) as response:
                if response.status == 200:
                    self.while_waiting()
                    return time.monotonic() - self.started_at
            time.sleep(1.0)
        raise TimeoutError(f"{self.kind} not ready after {timeout:.0f} s:\n{self.log()[-6000:]}")

    def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url(path), json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result

    def post_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.post_json(COMPLETIONS_PATH, body)

    def metrics_page(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as response:
            return str(response.read().decode())

    def manifests(self) -> list[Path]:
        return sorted(self.manifest_dir.glob("*.json"))

    def reports_by_pid(self, pattern: str) -> dict[int, dict[str, Any]]:
        """JSON reports the test plugins write into `report_dir`, per pid of the process that wrote them."""
        reports = {}
        for path in sorted(self.report_dir.glob(pattern)):
            data = json.loads(path.read_text())
            reports[int(data["pid"])] = data
        return reports
