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

from tests.deploy.helpers import (
    contract_metrics,
    dashboard,
    dashboard_targets,
    metrics_in,
    resolve_variables,
    run,
    tool,
)
from tests.support.constants import REPO

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
FILTER_VARIABLES = ("model", "stage", "gpu")


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_generated_files_are_current() -> None:
    run(sys.executable, str(REPO / "deploy/generate.py"), "--check")


def test_datasource_is_a_variable() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in FILTER_VARIABLES:
        variable = variables[name]
        assert variable["type"] == "query" and variable["datasource"] == DATASOURCE
        assert variable["refresh"] == 2, f"${name} must reload on time range change"
        assert variable["includeAll"] and variable["allValue"] == ".*"


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
    table = next(p for p in panels() if p["type"] == "table")
    assert all("capacity_source" in t["expr"] and "rows_reason" in t["expr"] for t in table["targets"])


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query (as a recording rule) with the variables resolved as "All" resolves them."""
    rules = [
        {"record": f"dashboard:query:{i}", "expr": resolve_variables(expr)}
        for i, (_, expr) in enumerate(dashboard_targets())
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run(tool("promtool"), "check", "rules", str(path))
