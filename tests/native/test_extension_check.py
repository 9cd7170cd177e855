"""A C extension that does not load is loud where the plugin is installed (`python -m kv_exporter.plugin --check`
exits 1) and where vLLM registers it (an error logged in each process), not only in a metric's reason. Each case runs
in a process of its own, where the tracker is made unloadable before anything imports it, as a missing or broken
build is: an import that fails."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.native.toolchain import TRACKER_MODULE
from tests.support.constants import REPO

BROKEN = "undefined symbol: _PyFrame_Nowhere"  # what a tracker built for another interpreter says
BREAK_TRACKER = f"""
import sys
class Broken:
    def find_spec(self, name, path=None, target=None):
        if name == {TRACKER_MODULE!r}:
            raise ImportError({BROKEN!r})
sys.meta_path.insert(0, Broken())
"""
REGISTER = """
import logging
logging.basicConfig(format="%(levelname)s %(name)s %(message)s")
import kv_exporter
kv_exporter.register()
print("registered")
"""
CHECK = """
from kv_exporter.plugin.extensions import main
sys.exit(main(["--check"]))
"""


def run(code: str, **environ: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("KV_EXPORTER_")}
    env.update(PYTHONPATH=str(REPO), **environ)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_check_passes_where_both_extensions_load() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kv_exporter.plugin", "--check"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "kv-exporter plugin check: ok (the cache tracker, the step record's writer load)\n"


def test_the_check_fails_naming_a_tracker_that_does_not_load_and_the_fix() -> None:
    done = run(BREAK_TRACKER + CHECK)
    assert done.returncode == 1
    assert f"the cache tracker ({TRACKER_MODULE}) cannot load (ImportError: {BROKEN})" in done.stderr
    assert "gcc and python3-dev" in done.stderr
    assert "step record" not in done.stderr  # the other extension loads


def test_registration_logs_an_error_when_observation_needs_a_tracker_that_does_not_load() -> None:
    done = run(BREAK_TRACKER + REGISTER)
    assert done.returncode == 0, done.stderr  # vLLM goes on: the declarations are still published
    assert done.stdout == "registered\n"
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR vllm.kv_exporter ")]
    assert len(errors) == 1, done.stderr
    assert f"the cache tracker ({TRACKER_MODULE}) cannot load (ImportError: {BROKEN})" in errors[0]
    assert "KV_EXPORTER_OBSERVE_INTERVAL=0" in errors[0]


@pytest.mark.parametrize(
    ("case", "environ"),
    [("observation off", {"KV_EXPORTER_OBSERVE_INTERVAL": "0"}), ("plugin disabled", {"KV_EXPORTER_DISABLE": "1"})],
)
def test_registration_is_quiet_where_nothing_needs_the_tracker(case: str, environ: dict[str, str]) -> None:
    done = run(BREAK_TRACKER + REGISTER, **environ)
    assert done.returncode == 0, done.stderr
    assert "ERROR" not in done.stderr, (case, done.stderr)


def test_registration_is_quiet_where_both_extensions_load() -> None:
    done = run("import sys\n" + REGISTER)
    assert done.returncode == 0
    assert done.stderr == ""
