"""A real Prometheus scraping `kv-exporter demo`: every dashboard query and variable, and every recording rule,
returns data. (The real-engine chain is tests/deploy/test_chain_engine.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.grafana import panels_without_data, query_variables, selection, variable_values
from tests.deploy.helpers import (
    RULES,
    Prometheus,
    prometheus_config,
    rule_groups,
    start_prometheus,
)
from tests.support.sidecar import sidecar

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with sidecar(tmp_path_factory.mktemp("demo"), command="demo") as running:
        yield running.address


@pytest.fixture(scope="module")
def prometheus(demo: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    workdir = tmp_path_factory.mktemp("prometheus-demo")
    config = prometheus_config([demo])
    with start_prometheus(workdir, config, {RULES.name: RULES.read_text()}) as prometheus:
        yield prometheus


def test_exporter_is_scraped(prometheus: Prometheus) -> None:
    (sample,) = prometheus.wait_for('up{job="kv-exporter"} == 1', 30)
    assert sample["metric"]["job"] == "kv-exporter"


def test_every_dashboard_query_returns_data(prometheus: Prometheus) -> None:
    prometheus.wait_for('up{job="kv-exporter"} == 1', 30)
    # Rate windows ($__rate_interval = 1m here) need two samples inside them.
    prometheus.wait_for("count_over_time(model_local_kv_nvml_up[1m]) >= 3", 30)
    missing = panels_without_data(prometheus, 30)
    assert not missing, "panels without data:\n" + "\n".join(missing)


POD_VARIABLES = ("namespace", "pod")
# Labels a global ruler (cluster) or the Kubernetes monitors (node) add: a plain Prometheus has neither, and All (.*)
# keeps every panel's data (test_every_dashboard_query_returns_data).
TARGET_VARIABLES = ("cluster", "node")


def test_every_dashboard_variable_has_values(prometheus: Prometheus) -> None:
    prometheus.wait_for('up{job="kv-exporter"} == 1', 30)
    chosen = selection(prometheus)  # fails for a variable without values at All
    for variable in query_variables():
        values = variable_values(prometheus, variable, chosen)
        if variable["name"] in POD_VARIABLES + TARGET_VARIABLES:  # outside Kubernetes: nothing, not ""
            assert values == [], f"${variable['name']}: the demo has no such label, yet {values}"
        else:
            assert values, f"${variable['name']}: no values for {variable['query']}"


def test_every_recording_rule_returns_data(prometheus: Prometheus) -> None:
    prometheus.wait_for('up{job="kv-exporter"} == 1', 30)
    for group in rule_groups():
        for rule in group["rules"]:
            if "record" in rule:
                prometheus.wait_for(rule["record"], 30, what=f"recording rule {rule['record']}")


def test_prometheus_loaded_every_rule(prometheus: Prometheus) -> None:
    groups = prometheus.api("rules")["groups"]
    loaded = {r["name"] for g in groups for r in g["rules"]}
    expected = {r.get("alert") or r["record"] for g in rule_groups() for r in g["rules"]}
    assert loaded == expected
    assert Path(RULES).exists()
