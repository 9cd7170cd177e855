"""dashboards/kv-exporter.json: generated from dashboards/build.py, linted, every query valid PromQL.

The lint rules follow Grafana's dashboard-linter (which is a Go tool, not installable here): the data source
is a variable, every panel and query uses it, rate-like functions use $__rate_interval, query variables reload
on time change; plus layout and contract checks of our own.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

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
