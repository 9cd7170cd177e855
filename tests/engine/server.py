"""Starting and stopping a real vLLM 0.32 CPU OpenAI server from the main venv, in .venv-vllm.

Each server runs in its own session (process group = its pid), so `stop()` reaches the engine core and the
workers too; it is idempotent and is also registered as a finalizer by the fixtures, so a failing test never
leaves a process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.openai_server import OpenAIServer
from tests.support.constants import REPO
from tests.support.net import free_port

VLLM_VENV = REPO / ".venv-vllm"
# .venv-vllm installs kv_exporter and the test plugin in editable mode from whichever checkout built it; these put
# this checkout's copies first, in every process of the server.
CHECKOUT_PATHS = (REPO, REPO / "tests" / "engine" / "testplugin")
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
SERVED_NAME = "kvx-tiny"
MAX_NUM_SEQS = 8
READY_TIMEOUT_S = 420.0  # a fresh CI machine compiles nothing (eager) but imports cold: ~90 s measured

# FIELD-NOTES recipe. VLLM_PLUGINS keeps vllm-omni's own general plugin (installed with the wheel, broken on
# vLLM 0.32) out of every process; it only adds a traceback per process.
BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_PLUGINS": "kv_exporter,kvx_testplugin",
}


@dataclass
class Server(OpenAIServer):
    workdir: Path
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    manifest_dir: Path
    report_dir: Path
    started_at: float
    exit_code: int | None = field(default=None)
    kind = "vLLM server"

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        return super().wait_ready(timeout)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM the server (as Kubernetes signals PID 1 only), give its children time to finish their own
        shutdown, then SIGKILL whatever is left of the process group. Idempotent."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.exit_code = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.exit_code = None
        deadline = time.monotonic() + 30
        while group_members(self.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        _signal_group(self.pid, signal.SIGKILL)
        if self.proc.returncode is None:
            self.proc.wait(timeout=30)
        return self.exit_code

    def completion(self, prompt: str | list[str], max_tokens: int = 16) -> dict[str, Any]:
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return self.post_completion(body)

    def batched_completion(self, count: int, max_tokens: int) -> dict[str, Any]:
        """One request of `count` prompts: the API server admits them together, so the engine runs them as one batch
        from the first step (separate client threads reach it staggered when the engine keeps the cores busy)."""
        return self.completion([f"The quick brown fox {i}" for i in range(count)], max_tokens)

    def concurrent_completions(self, count: int, max_tokens: int) -> list[dict[str, Any]]:
        results: list[dict[str, Any] | BaseException] = [RuntimeError("not run")] * count

        def run(i: int) -> None:
            try:
                results[i] = self.completion(f"The quick brown fox {i}", max_tokens)
            except BaseException as exc:
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if isinstance(r, dict)]

    def collective_rpc(self, method: str, *args: str) -> list[Any]:
        """Call `method` on every worker (vLLM's /collective_rpc: only with VLLM_SERVER_DEV_MODE=1)."""
        results: list[Any] = self.post_json("/collective_rpc", {"method": method, "args": list(args)})["results"]
        return results

    def report(self) -> dict[int, dict[str, Any]]:
        """The test plugin's reports, per pid of the process that wrote them."""
        return self.reports_by_pid("*.json")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def start_server(
    workdir: Path,
    model_dir: Path,
    *,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    manifest_dir: Path | None = None,
    eager: bool = True,
) -> Server:
    """Start the real OpenAI-compatible server (not yet ready: call wait_ready). `eager=False` leaves out
    --enforce-eager: vLLM's CPU path then compiles the model's backbone (dynamo, inductor)."""
    workdir.mkdir(parents=True, exist_ok=True)
    manifests = manifest_dir or workdir / "manifests"
    report_dir = workdir / "report"
    report_dir.mkdir(exist_ok=True)
    port = free_port()
    python_path = [str(path) for path in CHECKOUT_PATHS] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    full_env = {
        **os.environ,
        **BASE_ENV,
        "PYTHONPATH": os.pathsep.join(python_path),
        "KV_EXPORTER_DIR": str(manifests),
        "KVX_TEST_REPORT_DIR": str(report_dir),
        **(env or {}),
    }
    command = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        *(["--enforce-eager"] if eager else []),
        "--max-model-len", "256", "--max-num-seqs", str(MAX_NUM_SEQS), "--dtype", "float32",
        *(args or []),
    ]  # fmt: skip
    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, cwd=workdir, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Server(workdir, port, proc, log_path, manifests, report_dir, time.monotonic())
