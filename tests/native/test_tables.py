"""The tracker's tables in C, alone (tests/native/test_tables.c against _tables.h), built with both sanitizers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.native.toolchain import OBSERVE, SANITIZE, compile_c, embedding_flags, sanitizer_env, sanitizer_reports

HERE = Path(__file__).parent


def test_the_tables_pass_their_c_tests(tmp_path: Path) -> None:
    program = tmp_path / "test_tables"
    compile_c(
        [
            "-Wall",
            "-Wextra",
            "-Werror",
            *SANITIZE,
            f"-I{OBSERVE}",
            HERE / "test_tables.c",
            "-o",
            program,
            *embedding_flags(),
        ]
    )
    reports = tmp_path / "sanitizer"
    env = sanitizer_env(dict(os.environ), reports)
    del env["LD_PRELOAD"]  # the program links the runtime itself
    result = subprocess.run([program], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert sanitizer_reports(reports) == ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "tables: ok"
