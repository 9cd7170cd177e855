"""The observation alerts on real figures: promtool unit tests generated from the sidecar pages a real vLLM engine
produced (tests/fixtures/observed/, recorded by tests/engine/test_observed_engine.py).

Each recorded page becomes promtool input series: every sample, with the `job` and `instance` labels Prometheus adds
and without empty labels (Prometheus drops them at ingestion), held constant for 40 minutes. The shipped rules run
on them unchanged (annotations left out: promtool would compare their rendered text); each of the four observation
alerts must fire for exactly the owner or engine it is about, once its `for` has passed, and stay silent elsewhere:

- under load: the owner declaring one FIXED row while holding a row per request exceeds its declaration; the owner
  declaring nothing holds an undeclared cache, and so does the one whose caches live only inside steps (its peak
  between samples, whatever the sample itself saw); the owner declaring max_num_seqs rows and holding nothing, while
  requests run, never allocates; the truthful owner sets off none of them; the observation is ok;
- idle: nothing runs and nothing is held: none fires;
- the sampler stopped (the worker SIGSTOPped): the observation is stale, and no figure is there to alert on.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.helpers import alerts, page_series, tool, write_rules_without_annotations
from tests.engine.testplugin.kvx_testplugin import geometry as g
from tests.support.constants import FIXTURES
from tests.support.scrape import parse

RECORDED = FIXTURES / "observed"
JOB = {"job": "kv-exporter", "instance": "recorded-node:9477"}
HELD_MINUTES = 40
FIRED_AT = "20m"  # past every `for` (15m at most)
PENDING_AT = "5m"  # before any of them

EXCEEDS = "ModelLocalKVOwnerExceedsDeclaration"
UNDECLARED = "ModelLocalKVUndeclaredCache"
NEVER = "ModelLocalKVDeclaredNeverAllocated"
UNAVAILABLE = "ModelLocalKVObservationUnavailable"
OBSERVATION_ALERTS = (EXCEEDS, UNDECLARED, NEVER, UNAVAILABLE)

Labels = dict[str, str]


def ingested(labels: tuple[tuple[str, str], ...]) -> Labels:
    return {**{key: value for key, value in labels if value}, **JOB}


def input_series(page: str) -> list[dict[str, str]]:
    """Every sample of a recorded page, as Prometheus would have stored it, constant for HELD_MINUTES."""
    return page_series(page, JOB, HELD_MINUTES)


def labels_of(page: str, name: str, **match: str) -> Labels:
    """The stored labels of the one sample of `name` whose labels include `match`."""
    found = [
        ingested(labels) for (n, labels), _ in parse(page).items() if n == name and set(match.items()) <= set(labels)
    ]
    assert len(found) == 1, (name, match, found)
    return found[0]


def firing(alert: str, labels: Labels) -> dict[str, Any]:
    severity = next(a["labels"]["severity"] for a in alerts() if a["alert"] == alert)
    return {"exp_labels": {**labels, "severity": severity}}


def expected_alerts(name: str, page: str) -> dict[str, list[dict[str, Any]]]:
    """Which observation alerts a recorded page must set off, and for which series."""
    none: dict[str, list[dict[str, Any]]] = {alert: [] for alert in OBSERVATION_ALERTS}
    if name == "under-load.prom":
        owner = "model_local_kv_observed_peak_bytes"  # what the held-KV alerts read: a step's caches count
        return {
            **none,
            EXCEEDS: [firing(EXCEEDS, labels_of(page, "model_local_kv_unexplained_bytes", owner=g.UNDER_OWNER))],
            UNDECLARED: [
                firing(UNDECLARED, labels_of(page, owner, owner=undeclared))
                for undeclared in sorted((g.UNDECLARED_OWNER, g.IN_STEP_OWNER))
            ],
            NEVER: [firing(NEVER, labels_of(page, owner, owner=g.NEVER_OWNER))],
        }
    if name == "sampler-stopped.prom":
        stale = labels_of(page, "model_local_kv_observation_state", state="stale")
        return {**none, UNAVAILABLE: [firing(UNAVAILABLE, stale)]}
    assert name == "idle.prom", name
    return none


def promtool_test(name: str, expected: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    page = (RECORDED / name).read_text()
    cases = [{"eval_time": PENDING_AT, "alertname": alert, "exp_alerts": []} for alert in OBSERVATION_ALERTS]
    cases += [{"eval_time": FIRED_AT, "alertname": alert, "exp_alerts": fired} for alert, fired in expected.items()]
    return {"name": name, "interval": "1m", "input_series": input_series(page), "alert_rule_test": cases}


def run_promtool(folder: Path, tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    rule_file = write_rules_without_annotations(folder)
    document = {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests}
    (folder / "recorded.test.yml").write_text(yaml.safe_dump(document, sort_keys=False))
    return subprocess.run(
        [tool("promtool"), "test", "rules", "recorded.test.yml"], cwd=folder, capture_output=True, text=True
    )


PAGES = ("under-load.prom", "idle.prom", "sampler-stopped.prom")


@pytest.mark.parametrize("name", PAGES)
def test_observation_alerts_on_a_recorded_page(name: str, tmp_path: Path) -> None:
    expected = expected_alerts(name, (RECORDED / name).read_text())
    result = run_promtool(tmp_path, [promtool_test(name, expected)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_observation_alert_is_shown_firing_and_silent() -> None:
    shown = {name: expected_alerts(name, (RECORDED / name).read_text()) for name in PAGES}
    for alert in OBSERVATION_ALERTS:
        assert any(page[alert] for page in shown.values()), f"{alert} never fires on a recorded page"
        assert any(not page[alert] for page in shown.values()), f"{alert} never stays silent on a recorded page"


def test_the_truthful_owner_sets_off_nothing(tmp_path: Path) -> None:
    """The generated tests can fail: expecting the exceeded-declaration alert for the truthful owner too does."""
    page = (RECORDED / "under-load.prom").read_text()
    expected = expected_alerts("under-load.prom", page)
    truthful = labels_of(page, "model_local_kv_unexplained_bytes", owner=g.TRUTHFUL_OWNER)
    expected[EXCEEDS] = [*expected[EXCEEDS], firing(EXCEEDS, truthful)]
    result = run_promtool(tmp_path, [promtool_test("under-load.prom", expected)])
    assert result.returncode != 0
    assert EXCEEDS in result.stdout + result.stderr
