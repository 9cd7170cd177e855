"""dashboards/kv-exporter.json: generated from dashboards/build.py, linted, every query valid PromQL.

The lint rules are Grafana's dashboard-linter's (a Go tool no registry here ships: tests/deploy/dashboard_linter.py
implements them): the data source is a variable, every panel and query uses it, rate-like functions use
$__rate_interval, query variables reload on time change, the dashboard is not editable; plus layout and contract
checks of our own.
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.dashboard_linter import RULES, lint
from tests.deploy.grafana import FILTER_VARIABLES, SELECTOR, interpolate
from tests.deploy.helpers import (
    contract_metrics,
    dashboard,
    dashboard_targets,
    metrics_in,
    run,
    tool,
)

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ALL = {"selected": True, "text": ["All"], "value": ["$__all"]}


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def fleet_panels() -> set[int]:
    """The ids of the panels under the first row, the fleet row."""
    ids, row = set(), None
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        elif row == "Fleet":
            ids.add(panel["id"])
    return ids


def test_generated_files_are_current() -> None:
    # As a module from the checkout, so that it reads this checkout's kv_exporter, not an installed copy.
    run(sys.executable, "-m", "deploy.generate", "--check")


def test_variables_follow_vllm_conventions() -> None:
    """datasource, then cluster, job, node, instance, namespace, pod, model_name, stage, engine, gpu: multi-select
    with All, reloaded on time change, each chained on the ones before it (label_values filtered by them)."""
    variables = dashboard()["templating"]["list"]
    assert [v["name"] for v in variables] == ["datasource", *FILTER_VARIABLES]
    assert variables[0]["type"] == "datasource" and variables[0]["query"] == "prometheus"
    for before, variable in enumerate(variables[1:]):
        name = variable["name"]
        assert variable["type"] == "query" and variable["datasource"] == DATASOURCE, name
        assert variable["refresh"] == 2, f"${name} must reload on time range change"
        assert variable["multi"] and variable["includeAll"] and variable["current"] == ALL, name
        assert re.fullmatch(rf"label_values\(.+, {name}\)", variable["query"]), variable["query"]
        parents = set(re.findall(r'(\w+)=~"\$(\w+)"', variable["query"]))
        assert {(label, label) for label in FILTER_VARIABLES[:before] if label in ("job", "instance")} <= parents
        assert {p for p, _ in parents} <= set(FILTER_VARIABLES[:before]), f"${name} filters by a later variable"
    # All as `.+` where the label is on every series (dashboard-linter's rule), `.*` where it may be absent.
    assert {v["name"]: v.get("allValue") for v in variables[1:]} == {
        name: ".+" if name in ("job", "instance") else ".*" for name in FILTER_VARIABLES
    }


def test_dashboard_conventions() -> None:
    """Tag `vllm` and a link to the other dashboards so tagged, a current schema, nothing Grafana has deprecated."""
    board = dashboard()
    assert "vllm" in board["tags"]
    assert any(link["type"] == "dashboards" and link["tags"] == ["vllm"] for link in board["links"])
    assert board["schemaVersion"] >= 39
    assert not {"style", "rows"} & set(board), "dashboard fields removed from Grafana's schema"
    for variable in board["templating"]["list"]:
        stale = {"id", "tags", "tagsQuery", "useTags", "auto", "auto_count", "auto_min"} & set(variable)
        assert not stale, f"${variable['name']}: {stale}"
    for panel in board["panels"]:
        assert panel["type"] not in ("graph", "singlestat", "table-old"), panel["title"]
        assert "span" not in panel and not isinstance(panel.get("datasource"), str), panel["title"]
        legend = panel.get("options", {}).get("legend", {})
        assert legend.get("displayMode") != "hidden", f"{panel['title']}: use showLegend (schema 37)"
        custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
        assert "displayMode" not in custom, f"{panel['title']}: use cellOptions (schema 38)"


def test_every_query_is_filtered_by_job_and_instance() -> None:
    """Every metric a query reads is filtered to the selected scrape jobs and exporters: with two hosts no panel
    mixes them. (Which other variables apply to which family is checked against real series in
    test_dashboard_fleet.py.)"""
    for title, expr in dashboard_targets():
        found = SELECTOR.findall(expr)
        assert found, f"{title}: no metric in {expr}"
        for metric, matchers in found:
            for label in ("job", "instance"):
                assert f'{label}=~"${label}"' in matchers, f"{title}: {metric} is not filtered by ${label}"


def test_legends_name_the_instance() -> None:
    """Every legend names its exporter, but the fleet row's counts (one value for the fleet)."""
    fleet = fleet_panels()
    for panel in panels():
        if panel["id"] in fleet:
            assert panel["type"] == "table" or "instance" not in panel["targets"][0]["expr"].split("count(")[0]
            continue
        for target in panel["targets"]:
            if panel["type"] == "table":
                (organize,) = [x for x in panel["transformations"] if x["id"] == "organize"]
                assert "instance" not in organize["options"]["excludeByName"]
            else:
                assert "{{instance}}" in target["legendFormat"], f"{panel['title']}: {target['legendFormat']}"


def test_every_panel_and_query_uses_the_variable() -> None:
    for panel in panels():
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert target.get("datasource", DATASOURCE) == DATASOURCE


def test_panels_have_titles_descriptions_units_and_unique_ids() -> None:
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels():
        assert panel["title"].strip() and panel.get("description", "").strip(), panel["id"]
        if panel["type"] in ("timeseries", "stat"):
            assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]


def test_layout_fits_the_grid_without_overlap() -> None:
    occupied: set[tuple[int, int]] = set()
    for panel in dashboard()["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells


def test_rate_functions_use_rate_interval() -> None:
    for title, expr in dashboard_targets():
        for window in re.findall(r"\b(?:rate|irate|increase|delta)\([^\[]*\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", f"{title}: [{window}]"


def test_filters_are_applied_and_defined() -> None:
    defined = {v["name"] for v in dashboard()["templating"]["list"]}
    used: set[str] = set()
    for title, expr in dashboard_targets():
        names = set(re.findall(r"\$(?!__)(\w+)", expr))
        assert names <= defined, f"{title}: undefined {names - defined}"
        used |= names
    assert set(FILTER_VARIABLES) <= used


def test_queries_read_contract_metrics() -> None:
    known = contract_metrics()
    for title, expr in dashboard_targets():
        unknown = metrics_in(expr) - known
        assert not unknown, f"{title}: {unknown} not in docs/CONTRACTS.md"


def test_required_views_are_present() -> None:
    exprs = " ".join(expr for _, expr in dashboard_targets())
    for metric in (
        "model_local_kv_gpu_memory_used_bytes",
        "model_local_kv_gpu_projected_peak_bytes",
        "model_local_kv_gpu_memory_total_bytes",
        "model_local_kv_gpu_headroom_bytes",
        "model_local_kv_ceiling_bytes",
        "model_local_kv_estimated_bytes",
        "model_local_kv_running_sequences",
        "model_local_kv_max_num_seqs",
        "model_local_kv_declaration_info",
        "model_local_kv_nvml_up",
    ):
        assert metric in exprs, metric
    table = next(p for p in panels() if p["title"] == "Declarations")
    assert all("capacity_source" in t["expr"] and "rows_reason" in t["expr"] for t in table["targets"])


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query (as a recording rule) with every variable substituted as `.*`."""
    rules = [
        {"record": f"dashboard:query:{i}", "expr": interpolate(expr, dict.fromkeys(FILTER_VARIABLES, ".*"))}
        for i, (_, expr) in enumerate(dashboard_targets())
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run(tool("promtool"), "check", "rules", str(path))


def test_dashboard_linter_rules_pass() -> None:
    """grafana/dashboard-linter's rules (tests/deploy/dashboard_linter.py): today's main failed template-job-rule and
    template-instance-rule (allValue) and uneditable-dashboard."""
    problems = {rule: found for rule, found in lint(dashboard()).items() if found}
    assert not problems


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation: the value at `path` (keys and list indexes, dot-separated; `name=X` picks a list item)."""

    def mutate(board: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = board
        for key in parents:
            if "=" in key:
                field, wanted = key.split("=")
                node = next(item for item in node if item.get(field) == wanted)
            else:
                node = node[int(key)] if key.isdigit() else node[key]
        node[last] = value

    return mutate


def _first_target(board: dict[str, Any]) -> dict[str, Any]:
    target: dict[str, Any] = next(p for p in board["panels"] if p.get("targets"))["targets"][0]
    return target


MUTATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "template-datasource-rule": _set("templating.list.0.name", "ds"),
    "template-job-rule": _set("templating.list.name=job.allValue", ".*"),
    "template-instance-rule": _set("templating.list.name=instance.multi", False),
    "template-label-promql-rule": _set("templating.list.name=pod.query", "label_values(up{, pod)"),
    "template-on-time-change-reload-rule": _set("templating.list.name=gpu.refresh", 1),
    "panel-datasource-rule": lambda b: next(p for p in b["panels"] if p["type"] == "timeseries").update(
        datasource={"type": "prometheus", "uid": "prometheus"}
    ),
    "panel-title-description-rule": lambda b: next(p for p in b["panels"] if p["type"] == "stat").pop("description"),
    "panel-units-rule": lambda b: next(p for p in b["panels"] if p["type"] == "timeseries")["fieldConfig"][
        "defaults"
    ].update(unit="furlongs"),
    "panel-no-targets-rule": lambda b: next(p for p in b["panels"] if p["type"] == "stat").pop("targets"),
    "target-promql-rule": lambda b: _first_target(b).update(expr='sum(up{job=~"$job",instance=~"$instance"}'),
    "target-rate-interval-rule": lambda b: _first_target(b).update(
        expr='rate(up{job=~"$job",instance=~"$instance"}[5m])'
    ),
    "target-job-rule": lambda b: _first_target(b).update(expr='up{instance=~"$instance"}'),
    "target-instance-rule": lambda b: _first_target(b).update(expr='up{job=~"$job"}'),
    "target-counter-agg-rule": lambda b: _first_target(b).update(
        expr='model_local_kv_manifest_errors_total{job=~"$job",instance=~"$instance"}'
    ),
    "uneditable-dashboard": _set("editable", True),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_linter_rule_can_fail(rule: str) -> None:
    board = copy.deepcopy(dashboard())
    MUTATIONS[rule](board)
    assert lint(board)[rule], f"{rule} passed a dashboard that breaks it"


def test_inputs_let_grafana_import_it() -> None:
    """Grafana's import asks for each `__inputs` data source and writes it where `${NAME}` stands: here the data
    source variable's default. `__requires` names the Grafana version and every plugin the panels use."""
    board = dashboard()
    (source_input,) = board["__inputs"]
    assert (source_input["type"], source_input["pluginId"]) == ("datasource", "prometheus")
    (variable,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert variable["current"]["value"] == "${" + source_input["name"] + "}"
    required = {(r["type"], r["id"]) for r in board["__requires"]}
    assert {("grafana", "grafana"), ("datasource", "prometheus")} <= required
    assert {("panel", p["type"]) for p in panels()} <= required
