"""A short coverage-guided run of each atheris target (2,000 inputs), as `make test` does; `make fuzz` runs
100,000+. Needs .venv-fuzz (built by `make fuzz-env`, i.e. scripts/fuzz.sh --env-only)."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.fuzz.seed_corpus import write_seeds
from tests.support.constants import REPO

FUZZ_PY = REPO / ".venv-fuzz" / "bin" / "python"
RUNS = 2000
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    not FUZZ_PY.exists(), reason="no .venv-fuzz (run `make fuzz-env` or scripts/fuzz.sh --env-only)"
)


def run_fuzzer(args: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [str(FUZZ_PY), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def executed_units(log: str) -> int:
    found = re.findall(r"^stat::number_of_executed_units:\s*(\d+)", log, re.MULTILINE)
    return int(found[-1]) if found else 0


@pytest.mark.parametrize("target", ["manifest", "engine_page", "fetch"])
def test_a_short_coverage_guided_run_finds_nothing(target: str, tmp_path: Path) -> None:
    corpus = write_seeds(tmp_path / "corpus")[target]
    result = run_fuzzer(
        [
            f"tests/fuzz/fuzz_{target}.py",
            f"-runs={RUNS}",
            "-seed=1",
            "-max_len=131072",
            "-print_final_stats=1",
            f"-artifact_prefix={tmp_path}/crash-",
            str(corpus),
        ]
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert executed_units(result.stderr) >= RUNS, result.stderr[-2000:]
    assert not list(tmp_path.glob("crash-*"))


def test_an_untyped_exception_is_reported_as_a_crash(tmp_path: Path) -> None:
    # The harness must turn anything but the typed rejection into a crash with a reproducer; prove it by
    # breaking the reader on purpose (a KeyError on every input) in a copy of the manifest target.
    broken = tmp_path / "broken_target.py"
    broken.write_text(
        textwrap.dedent(
            """
            import sys
            import atheris
            import tests.fuzz.inputs as inputs

            def parse_manifest(data, source):
                raise KeyError("a reader bug")

            inputs.parse_manifest = parse_manifest
            atheris.Setup(sys.argv, inputs.check_manifest)
            atheris.Fuzz()
            """
        )
    )
    result = run_fuzzer([str(broken), "-runs=100", f"-artifact_prefix={tmp_path}/crash-"])
    assert result.returncode != 0
    output = result.stdout + result.stderr  # atheris prints the Python traceback on stdout
    assert "KeyError" in output and "a reader bug" in output, output[-2000:]
    assert list(tmp_path.glob("crash-*")), result.stderr[-2000:]
