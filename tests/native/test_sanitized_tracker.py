"""The tracker's Python tests again, against the tracker built with AddressSanitizer and UndefinedBehaviorSanitizer:
an out-of-bounds access, a use after free (objects too: PYTHONMALLOC=malloc), a misaligned or overflowing operation
anywhere in _tracker.c or _tables.h stops the run with the sanitizer's report. The interpreter and torch are not
instrumented; libasan is preloaded for them (the tests' own subprocesses get the usual build).

Not the harm cases (test_observer_never_harms.py): each runs in processes of its own, minutes long, under the usual
build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.native.toolchain import (
    TRACKER_MODULE,
    build_sanitized_tracker,
    preloading,
    sanitizer_env,
    sanitizer_reports,
)
from tests.support.constants import REPO

TRACKER_TESTS = [
    "tests/torch/test_plugin_observe.py",
    "tests/torch/test_plugin_observe_update_hook.py",
    "tests/torch/test_plugin_observe_peak.py",
    "tests/torch/test_plugin_observe_holders.py",
    "tests/torch/test_plugin_observe_limit.py",
    "tests/torch/test_plugin_observe_at_sample.py",
    "tests/torch/test_plugin_observe_degrade.py",
    "tests/native/test_tracker_refleaks.py",
]
TIMEOUT_S = 600


def test_the_tracker_tests_pass_under_both_sanitizers(tmp_path: Path) -> None:
    extension = build_sanitized_tracker(tmp_path)
    reports = tmp_path / "sanitizer"
    run_tests = f"""
import pytest
code = pytest.main(["-q", "-x", "-p", "no:cacheprovider", *{TRACKER_TESTS!r}])
used = sys.modules[{TRACKER_MODULE!r}].__file__
assert used == {str(extension)!r}, f"the tests ran against {{used}}"
sys.exit(code)
"""
    result = subprocess.run(
        [sys.executable, "-c", preloading(extension, run_tests)],
        cwd=REPO,
        env=sanitizer_env({**os.environ, "PYTHONPATH": str(REPO)}, reports),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert sanitizer_reports(reports) == ""
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
