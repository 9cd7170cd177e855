"""The metrics table is the one description of the exported families: the page, the docs, the dashboards, the rules
and the series budget agree with it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kv_exporter.engine_memory import EngineMemory
from kv_exporter.sidecar import budget
from kv_exporter.sidecar.metric_spec import Per, When
from kv_exporter.sidecar.metrics_docs import reference, with_reference
from kv_exporter.sidecar.metrics_table import TABLE, WEB_CONFIG_RELOAD, rows, series
from tests.support.constants import REPO

BY_NAME = {spec.name: spec for spec in TABLE}
GOLDEN = sorted((REPO / "tests" / "golden").glob("*.prom"))
# A metric name in prose, a rule or a dashboard: not a prefix (`model_local_kv_worker_*`), a recording rule's
# `level:metric:operation` name, nor part of a longer identifier (`collect_model_local_kv_specs`).
NAME_IN_TEXT = re.compile(r"(?<![\w:])model_local_kv_[a-z0-9_]*[a-z0-9](?![\w:*(])")


def test_every_row_is_its_own_family() -> None:
    assert len(BY_NAME) == len(TABLE) > 60
    assert all(spec.name.startswith("model_local_kv_") and spec.help.endswith(".") for spec in TABLE)
    assert all(spec.labels[-1:] in ((), ("state",), ("limit",)) for spec in TABLE if spec.values)


def families_of(golden: Path) -> list[Metric]:
    """The golden page's families; its two normalised values (tests/golden/test_golden.py) as numbers again."""
    text = golden.read_text().replace(" DURATION\n", " 0.01\n").replace(" AGE\n", " 1.0\n")
    return [f for f in text_string_to_metric_families(text) if f.name.startswith("model_local_kv_")]


@pytest.mark.parametrize("golden", GOLDEN, ids=lambda path: path.name)
def test_the_golden_page_holds_the_table_in_its_order(golden: Path) -> None:
    """Every family the real exporter wrote is a row with its type, help and labels, and every row is on the page (the
    web config's gauge needs --web.config.file), in the table's order."""
    page = families_of(golden)
    assert [f.name for f in page] == [spec.name for spec in TABLE if spec is not WEB_CONFIG_RELOAD]
    for family in page:
        spec = BY_NAME[family.name]
        assert (family.type, family.documentation) == (spec.exposed_type, spec.help), family.name
        for sample in family.samples:
            assert sample.name == spec.series_name
            assert set(sample.labels) <= set(spec.labels), family.name  # an empty value is left out
            if spec.values:
                assert sample.labels[spec.labels[-1]] in spec.values


def test_the_golden_pages_show_every_label_of_the_families_they_fill() -> None:
    seen: dict[str, set[str]] = {}
    for golden in GOLDEN:
        for family in families_of(golden):
            for sample in family.samples:
                seen.setdefault(family.name, set()).update(sample.labels)
    optional = {"allocation_note", "rows_reason", "pod", "namespace", "container"}  # empty in some fixtures
    for name, labels in seen.items():
        assert set(BY_NAME[name].labels) - labels <= optional, name


def test_docs_metrics_md_holds_the_generated_reference() -> None:
    """Regenerate with `python -m kv_exporter.sidecar.metrics_docs --write docs/metrics.md`."""
    text = (REPO / "docs" / "metrics.md").read_text()
    assert with_reference(text) == text
    assert all(f"| `{spec.series_name}` |" in reference() for spec in TABLE)


def test_a_stale_reference_is_rewritten() -> None:
    text = (REPO / "docs" / "metrics.md").read_text()
    stale = text.replace(f"| {TABLE[0].help} |", "| Something else. |")
    assert stale != text
    assert with_reference(stale) == text


@pytest.mark.parametrize(
    "path",
    [
        "docs/metrics.md",
        "docs/alerts.md",
        "docs/CONTRACTS.md",
        "dashboards/kv-exporter.json",
        "deploy/prometheus/kv-exporter.rules.yml",
        "deploy/prometheus/kv-exporter.thresholds.example.yml",
        "deploy/kubernetes/base/prometheusrule.yaml",
        "deploy/kubernetes/base/grafana-dashboard.json",
    ],
)
def test_every_metric_named_in_docs_rules_and_dashboards_is_in_the_table(path: str) -> None:
    named = set(NAME_IN_TEXT.findall((REPO / path).read_text()))
    assert named, path
    assert named - {spec.series_name for spec in TABLE} == set()


def test_series_counts_come_from_the_rows() -> None:
    """The budget's counts are the table's: a row added per engine raises the engine's count."""
    assert budget.SERIES_PER_DECLARATION == len(rows(Per.DECLARATION)) == 6
    assert budget.SERIES_PER_OWNER == len(rows(Per.OWNER)) == 4
    assert budget.SERIES_PER_PAGE_ENGINE == len(rows(Per.ENGINE, When.ALWAYS)) == 3
    states = sum(len(spec.values) for spec in rows(Per.ENGINE_STATE))
    assert series(Per.ENGINE_STATE) == states == 14
    cuda = series(Per.ENGINE_GPU, When.CUDA, When.CUDA_DETAILED, When.CUDA_WARM)
    assert len(rows(Per.ENGINE)) + states + cuda == budget.SERIES_PER_ENGINE


def test_each_engine_budget_figure_has_its_row() -> None:
    """budget.py counts an engine's budget series by the figures its manifest sets: one row each."""
    assert len(rows(Per.ENGINE_GPU, When.BUDGET)) == len(dataclasses.fields(EngineMemory))
