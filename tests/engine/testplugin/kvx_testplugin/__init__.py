"""Test-only vLLM general plugin (see model.py and observed.py)."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import sys
from pathlib import Path

# scripts/wheel-check.sh runs the engine tests on an installed wheel: set, every process of the engine (the API
# server, the engine core, its workers) records where kv_exporter and its two C extensions came from in the file
# ORIGIN_LOG_ENV names, and refuses to start unless all three are under the folder EXPECT_KV_EXPORTER_UNDER_ENV names.
EXPECT_KV_EXPORTER_UNDER_ENV = "KVX_TEST_EXPECT_KV_EXPORTER_UNDER"
ORIGIN_LOG_ENV = "KVX_TEST_ORIGIN_LOG"
ORIGIN_MODULES = ("kv_exporter", "kv_exporter.plugin.observe._tracker", "kv_exporter.plugin._steps")


def check_origin() -> None:
    expected = os.environ.get(EXPECT_KV_EXPORTER_UNDER_ENV)
    if not expected:
        return
    files = {name: str(importlib.import_module(name).__file__) for name in ORIGIN_MODULES}
    record = {"pid": os.getpid(), "process": multiprocessing.current_process().name, "argv": sys.argv[:2]}
    with open(os.environ[ORIGIN_LOG_ENV], "a", encoding="utf-8") as log:
        log.write(json.dumps({**record, "files": files}) + "\n")
    root = Path(expected).resolve()
    elsewhere = {name: file for name, file in files.items() if not Path(file).resolve().is_relative_to(root)}
    if elsewhere:
        raise RuntimeError(f"kvx_testplugin: kv_exporter is not the one under {root}: {elsewhere}")


def register() -> None:
    check_origin()
    # Lazy string form: vLLM imports the model module only where the model is built.
    from vllm import ModelRegistry

    from kvx_testplugin.geometry import ARCHITECTURE, OBSERVED_ARCHITECTURE

    for architecture, module in ((ARCHITECTURE, "model"), (OBSERVED_ARCHITECTURE, "observed")):
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, f"kvx_testplugin.{module}:{architecture}")
