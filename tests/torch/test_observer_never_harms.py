"""The observer never harms its engine: what model code and a busy engine do is the same with the plugin as without.

Each case (tests/support/harms.py) runs in a process of its own, with the plugin registered as vLLM registers it and
sampling every 2 ms, and again without the plugin (the control), under a timeout: a hang is a timeout, a crash a
signal. Real transformers caches throughout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def run(case: str, plugin: bool) -> dict[str, Any]:
    environ = {key: value for key, value in os.environ.items() if not key.startswith("KV_EXPORTER_")}
    environ["KV_EXPORTER_DIR"] = "/nonexistent/kv-exporter"  # nothing is published: no model runner here
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.support.harms", case, "on" if plugin else "off"],
            cwd=ROOT,
            env=environ,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"{case} ({'plugin' if plugin else 'control'}) hung for {TIMEOUT_S} s: {timeout.stderr!r}")
    assert done.returncode == 0, f"{case} exited {done.returncode}: {done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def cases() -> dict[tuple[str, bool], dict[str, Any]]:
    return {}


def both(cases: dict[tuple[str, bool], dict[str, Any]], case: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(with the plugin, without)."""
    for plugin in (True, False):
        if (case, plugin) not in cases:
            cases[case, plugin] = run(case, plugin)
    return cases[case, True], cases[case, False]


@pytest.mark.parametrize("kind", ["self", "layer", "request", "bound_method"])
def test_caches_in_reference_cycles_are_collected_and_finalized(
    cases: dict[tuple[str, bool], dict[str, Any]], kind: str
) -> None:
    ours, control = both(cases, "cycles")
    assert control[kind] == {"alive": 0, "deleted": 50, "tensors alive": 0}
    assert ours[kind] == control[kind]


def test_children_forked_while_sampling_never_hang(cases: dict[tuple[str, bool], dict[str, Any]]) -> None:
    ours, control = both(cases, "forks")
    assert control == {"forked": 200, "hung": 0, "failed": 0}
    assert ours == control


def test_a_model_thread_holding_its_lock_while_releasing_caches_never_deadlocks(
    cases: dict[tuple[str, bool], dict[str, Any]],
) -> None:
    ours, control = both(cases, "lock_inversion")
    assert ours == control == {"finished": 300}


def test_every_call_through_a_wrapped_method_means_what_it_meant(
    cases: dict[tuple[str, bool], dict[str, Any]],
) -> None:
    ours, control = both(cases, "calls")
    for cls, outcomes in control["outcomes"].items():
        assert ours["outcomes"][cls] == outcomes, cls
    # the corpus calls both ways: a valid call of the deprecated spelling, refusals with the original's own message
    assert control["outcomes"]["Deprecated"]["old keyword"][0] == "ok"
    assert control["outcomes"]["PositionalOnly"]["layer as keyword"][0] == "error"


def test_a_class_that_cannot_be_followed_costs_only_itself(cases: dict[tuple[str, bool], dict[str, Any]]) -> None:
    ours, _ = both(cases, "calls")
    assert (ours["state"], ours["reason"]) == ("ok", "")
    assert ours["good counted"]
    assert ours["unreadable"] == ["not_followed"]  # the partial, callable-object, static, class and builtin ones


def test_a_cache_released_while_it_is_read_leaves_nothing_counted(
    cases: dict[tuple[str, bool], dict[str, Any]],
) -> None:
    ours, _ = both(cases, "release_mid_reading")
    assert ours["later"] == [[], []]


def test_a_sample_before_a_cache_s_init_reports_nothing_unreadable(
    cases: dict[tuple[str, bool], dict[str, Any]],
) -> None:
    ours, _ = both(cases, "release_mid_reading")
    assert ours["before init"] == ours["after init"] == []
    assert ours["warnings"] == []


def test_memory_returns_after_a_crowd_of_caches(cases: dict[tuple[str, bool], dict[str, Any]]) -> None:
    ours, control = both(cases, "crowd")
    assert ours["peak MiB"] > 100  # the crowd was there
    assert ours["kept MiB"] <= control["kept MiB"] + 10, (ours, control)
