"""grafana/dashboard-linter's rules (lint/rules.go's rule set, read from its source), in Python: the linter is a Go
program that no registry this project uses ships. Each rule returns the problems it finds, worded after the
linter's messages; the PromQL rules hand every query to promtool (Prometheus' own parser) in one call.

Where this differs from the Go code, on purpose:
- variables are expanded as the linter does (in double quotes nothing is expanded, `$__rate_interval` and the other
  interval macros are durations, a query variable is its name), then parsed by promtool;
- `template-label-promql-rule` parses the selector of `label_values(selector, label)` (the Go rule parses the whole
  argument list and accepts it when the parser returns a partial expression);
- `target-counter-agg-rule` and `target-rate-interval-rule` read the query's text with regular expressions, not a
  syntax tree: a `_total` selector must be the argument of rate, irate or increase; rate and irate must use
  `$__rate_interval`.
The Loki rules (target-logql-rule, target-logql-auto-rule) have nothing to check on a Prometheus dashboard.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.helpers import tool

Dashboard = dict[str, Any]
Rule = Callable[[Dashboard], list[str]]

# lint/rule_panel_units.go's list, less the units no kv-exporter panel could mean (it is long): the families here.
VALID_UNITS = {"none", "short", "percent", "percentunit", "bytes", "decbytes", "s", "ms", "ns", "bool"}
CHECKED_PANELS = {"stat", "singlestat", "graph", "table-old", "timeseries", "gauge"}
DATASOURCE_PANELS = {"singlestat", "graph", "table-old", "timeseries"}
QUERY_PANELS = {"singlestat", "gauge", "table-old", "stat", "state-timeline", "timeseries"}
VARIABLE_FUNCTIONS = {"label_names", "label_values", "metrics", "query_result"}
MACROS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h", "__auto": "12s"}
RATE_INTERVAL = MACROS["__rate_interval"]
VARIABLE = re.compile(r"\$(\w+)|\$\{([^}]+)\}|\[\[([^\[\]]+)\]\]")


def panels(board: Dashboard) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row's


def targets(board: Dashboard) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in panels(board):
        for target in panel.get("targets") or []:
            yield panel, target


def variables(board: Dashboard) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = board["templating"]["list"]
    return found


def prometheus_source(board: Dashboard) -> bool:
    sources = [v for v in variables(board) if v["type"] == "datasource"]
    return bool(sources) and sources[0].get("query") == "prometheus"


def expand(expr: str) -> str:
    """The linter's sample values: nothing inside double quotes; macros as durations; a variable as its name."""

    def value(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g).split(":")[0]
        return MACROS.get(name, name)

    parts = expr.split('"')
    return '"'.join(part if i % 2 else VARIABLE.sub(value, part) for i, part in enumerate(parts))


def invalid_promql(exprs: list[str]) -> dict[str, str]:
    """The expressions promtool refuses, with its message: one promtool call for them all, one each if it fails."""

    def check(batch: list[str], folder: Path) -> str | None:
        rules = [{"record": "lint:query", "expr": expr} for expr in batch]
        path = folder / "queries.yml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "lint", "rules": rules}]}))
        done = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
        return None if done.returncode == 0 else (done.stdout + done.stderr).strip().splitlines()[-1]

    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        if not exprs or check(exprs, folder) is None:
            return {}
        return {expr: error for expr in exprs if (error := check([expr], folder)) is not None}


# --- the rules, in lint/rules.go's order ------------------------------------------------------------------------


def template_datasource_rule(board: Dashboard) -> list[str]:
    sources = [v for v in variables(board) if v["type"] == "datasource"]
    if not sources:
        return ["does not have a templated data source"]
    problems = []
    for source in sources:
        names = {f"{source['query'].lower()}_datasource"} | ({"datasource"} if len(sources) == 1 else set())
        labels = {f"{source['query'].title()} data source"} | ({"Data source"} if len(sources) == 1 else set())
        if source["name"] not in names:
            problems.append(f"templated data source variable named '{source['name']}', should be one of {names}")
        if source.get("label") not in labels:
            problems.append(f"templated data source variable labeled '{source.get('label')}', should be {labels}")
    return problems


def _template_rule(name: str) -> Rule:
    def rule(board: Dashboard) -> list[str]:
        if not prometheus_source(board):
            return []
        found = [v for v in variables(board) if v["name"] == name]
        if not found:
            return [f"is missing the {name} template"]
        variable, problems = found[0], []
        if variable.get("datasource", {}).get("uid") not in ("$datasource", "${datasource}"):
            problems.append(f"{name} template should use datasource '$datasource'")
        if variable["type"] != "query":
            problems.append(f"{name} template should be a Prometheus query, is currently '{variable['type']}'")
        if variable.get("label") != name.title():
            problems.append(f"{name} template should be labeled '{name.title()}'")
        if not variable.get("multi"):
            problems.append(f"{name} template should be a multi select")
        if variable.get("allValue") != ".+":
            problems.append(f"{name} template allValue should be '.+', is currently '{variable.get('allValue')}'")
        return problems

    return rule


template_job_rule = _template_rule("job")
template_instance_rule = _template_rule("instance")


def template_label_promql_rule(board: Dashboard) -> list[str]:
    if not prometheus_source(board):
        return []
    problems, selectors = [], {}
    for variable in variables(board):
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"([a-z_]+)\((.+)\)", variable["query"])
        if match is None or match.group(1) not in VARIABLE_FUNCTIONS:
            problems.append(f"template '{variable['name']}' invalid templated label '{variable['query']}'")
            continue
        selector = match.group(2).rsplit(",", 1)[0] if match.group(1) == "label_values" else match.group(2)
        selectors[expand(selector)] = variable["name"]
    for expr, error in invalid_promql(list(selectors)).items():
        problems.append(f"template '{selectors[expr]}' invalid templated label: {error}")
    return problems


def template_on_time_change_reload_rule(board: Dashboard) -> list[str]:
    return [
        f"templated datasource variable named '{v['name']}', should be set to be refreshed 'On Time Range Change "
        f"(value 2)', is currently '{v.get('refresh')}'"
        for v in variables(board)
        if v["type"] == "query" and v.get("refresh") != 2
    ]


def panel_datasource_rule(board: Dashboard) -> list[str]:
    allowed = {f"${v['name']}" for v in variables(board) if v["type"] == "datasource"}
    allowed |= {f"${{{name[1:]}}}" for name in allowed}
    return [
        f"panel '{p['title']}' does not use a templated datasource, uses '{(p.get('datasource') or {}).get('uid')}'"
        for p in panels(board)
        if p["type"] in DATASOURCE_PANELS and (p.get("datasource") or {}).get("uid") not in allowed
    ]


def panel_title_description_rule(board: Dashboard) -> list[str]:
    return [
        f"panel {p.get('id')} has missing title or description"
        for p in panels(board)
        if p["type"] in CHECKED_PANELS and not (p.get("title") and p.get("description"))
    ]


def panel_units_rule(board: Dashboard) -> list[str]:
    problems = []
    for panel in panels(board):
        if panel["type"] not in CHECKED_PANELS:
            continue
        if panel["type"] == "stat" and panel.get("options", {}).get("reduceOptions", {}).get("fields"):
            continue
        config = panel.get("fieldConfig", {})
        overrides = [p for o in config.get("overrides", []) for p in o.get("properties", [])]
        if any(p["id"] == "mappings" and p.get("value") for p in overrides) or config.get("defaults", {}).get(
            "mappings"
        ):
            continue
        units = [p["value"] for p in overrides if p["id"] == "unit"] or [config.get("defaults", {}).get("unit", "")]
        if units[-1] not in VALID_UNITS:
            problems.append(f"panel '{panel['title']}' has no or invalid units defined: '{units[-1]}'")
    return problems


def panel_no_targets_rule(board: Dashboard) -> list[str]:
    return [
        f"panel '{p['title']}' has no targets"
        for p in panels(board)
        if p["type"] in CHECKED_PANELS and p.get("targets") is None
    ]


def target_promql_rule(board: Dashboard) -> list[str]:
    if not prometheus_source(board):
        return []
    exprs = {expand(t["expr"]): p["title"] for p, t in targets(board) if p["type"] in QUERY_PANELS | {"table"}}
    return [f"panel '{exprs[e]}': invalid PromQL query: {error}" for e, error in invalid_promql(list(exprs)).items()]


def target_rate_interval_rule(board: Dashboard) -> list[str]:
    problems = []
    for panel, target in targets(board):
        for window in re.findall(r"\b(?:rate|irate)\s*\([^\[]*\[([^\]]+)\]", target["expr"]):
            if window != "$__rate_interval":
                problems.append(f"panel '{panel['title']}': should use $__rate_interval, uses [{window}]")
    return problems


def _target_matcher_rule(name: str) -> Rule:
    def rule(board: Dashboard) -> list[str]:
        problems = []
        for panel, target in targets(board):
            # Every vector selector: a metric name with its matchers, or matchers alone.
            for metric, matchers in re.findall(r'(?<![\w:"])([a-zA-Z_:][\w:]*)?\s*(\{[^}]*\})', target["expr"]):
                if f'{name}=~"${name}"' not in matchers.replace(" ", ""):
                    problems.append(f"panel '{panel['title']}': {metric or 'a selector'} has no {name}=~\"${name}\"")
            bare = re.findall(r'(?<![\w:$"])(model_local_kv_\w+|up)(?![\w:{(])', target["expr"])
            problems += [f"panel '{panel['title']}': {metric} has no {name} selector" for metric in bare]
        return problems

    return rule


target_job_rule = _target_matcher_rule("job")
target_instance_rule = _target_matcher_rule("instance")


def target_counter_agg_rule(board: Dashboard) -> list[str]:
    problems = []
    for panel, target in targets(board):
        expr = target["expr"]
        for match in re.finditer(r"(?<![\w:])(\w+_total)\b", expr):
            head = expr[: match.start()]
            if not re.search(r"\b(?:rate|irate|increase)\s*\(\s*$", head):
                problems.append(f"panel '{panel['title']}': counter metric '{match.group(1)}' is not aggregated")
    return problems


def uneditable_dashboard(board: Dashboard) -> list[str]:
    return ["is editable, it should be set to 'editable: false'"] if board.get("editable") else []


RULES: dict[str, Rule] = {
    "template-datasource-rule": template_datasource_rule,
    "template-job-rule": template_job_rule,
    "template-instance-rule": template_instance_rule,
    "template-label-promql-rule": template_label_promql_rule,
    "template-on-time-change-reload-rule": template_on_time_change_reload_rule,
    "panel-datasource-rule": panel_datasource_rule,
    "panel-title-description-rule": panel_title_description_rule,
    "panel-units-rule": panel_units_rule,
    "panel-no-targets-rule": panel_no_targets_rule,
    "target-promql-rule": target_promql_rule,
    "target-rate-interval-rule": target_rate_interval_rule,
    "target-job-rule": target_job_rule,
    "target-instance-rule": target_instance_rule,
    "target-counter-agg-rule": target_counter_agg_rule,
    "uneditable-dashboard": uneditable_dashboard,
}


def lint(board: Dashboard) -> dict[str, list[str]]:
    """Each rule's problems; empty lists where the dashboard passes."""
    return {name: rule(board) for name, rule in RULES.items()}
