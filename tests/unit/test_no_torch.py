"""The sidecar side of the package never imports torch or vllm."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.net import free_port

SIDECAR_MODULES = ["kv_exporter", "kv_exporter.protocol", "kv_exporter.manifest", "kv_exporter.reference"]


def test_importing_the_package_and_manifest_reader_imports_no_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {name}\n" for name in SIDECAR_MODULES)
        + "heavy = {'torch', 'vllm', 'vllm_omni', 'transformers'}\n"
        + "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


# Modules only `demo`, `report`, the landing page or --web.config.file need: `serve` must not pay for them at start-up.
ONLY_WHEN_USED = ["kv_exporter.sidecar.demo", "kv_exporter.sidecar.report", "kv_exporter.sidecar.landing",
                  "kv_exporter.sidecar.simulated_engine", "kv_exporter.web.config", "yaml", "bcrypt"]  # fmt: skip


def test_serve_loads_only_what_serving_metrics_needs(tmp_path: Path) -> None:
    """A real `serve` answering /metrics, then listing what it has imported (from a thread of its own process)."""
    port = free_port()
    code = (
        "import os, sys, threading, time, urllib.request\n"
        "def check():\n"
        "    for _ in range(600):\n"
        "        try:\n"
        f"            urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=5).read(); break\n"
        "        except OSError: time.sleep(0.05)\n"
        f"    print(','.join(sorted(m for m in {ONLY_WHEN_USED!r} if m in sys.modules)), flush=True)\n"
        "    os._exit(0)\n"
        "threading.Thread(target=check, daemon=True).start()\n"
        "from kv_exporter.sidecar.cli import main\n"
        f"main(['serve', '--manifest-dir', {str(tmp_path)!r}, '--simulate-gpu', '80GiB:60GiB',\n"
        f"      '--web.listen-address', '127.0.0.1:{port}'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"serve loaded {out.stdout.strip()} before anything used them"
