"""The sidecar side of the package never imports torch or vllm."""

from __future__ import annotations

import subprocess
import sys

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
