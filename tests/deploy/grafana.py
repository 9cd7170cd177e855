"""The dashboard's variables as Grafana resolves them for a Prometheus data source, so a test can run each panel's
queries as Grafana would send them: values from each variable's `label_values` query, chained in dashboard order;
a picked value regex-escaped; All as the variable's allValue or, without one, every value joined `(a|b)`."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from tests.deploy.helpers import Prometheus, dashboard, dashboard_targets

# vLLM's dashboards' variables (examples/observability in the vLLM repository), plus ours; named as their labels.
# `cluster` (a global ruler's external label) and `node` (the monitors' relabeling) are on every series.
FILTER_VARIABLES = ("cluster", "job", "node", "instance", "namespace", "pod", "model_name", "stage", "engine", "gpu")
# A metric and its label matchers, as the dashboard writes them (`on (...)`/`by (...)` lists hold no metric names).
SELECTOR = re.compile(r"(?<![\w:])(model_local_kv_[a-z_]+|up)\b(\{[^}]*\})?")
# The interval macros at the tests' short scrape interval.
INTERVALS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}
_REFERENCE = re.compile(r"\$(\w+)")
_REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|]")


def query_variables() -> list[dict[str, Any]]:
    return [v for v in dashboard()["templating"]["list"] if v["type"] == "query"]


def regex_escape(value: str) -> str:
    """Grafana's escape of one value for a `=~"..."` matcher: each regex metacharacter gets a backslash, written
    as `\\\\` inside the PromQL string."""
    return _REGEX_SPECIAL.sub(lambda m: "\\\\" + m.group(0), value.replace("\\", "\\\\\\\\"))


def interpolate(expr: str, chosen: Mapping[str, str]) -> str:
    """`expr` with every `$name` replaced: interval macros, then the variables' substituted texts."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in INTERVALS:
            return INTERVALS[name]
        if name not in chosen:
            raise KeyError(f"${name} in {expr!r} is no dashboard variable")
        return chosen[name]

    return _REFERENCE.sub(replace, expr)


def label_values_query(variable: dict[str, Any]) -> tuple[str, str]:
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"])
    assert match, variable["query"]
    return match.group(1), match.group(2)


def variable_values(prometheus: Prometheus, variable: dict[str, Any], chosen: Mapping[str, str]) -> list[str]:
    """What Grafana offers for `variable` with the variables before it substituted as `chosen`."""
    selector, label = label_values_query(variable)
    values: list[str] = prometheus.api(f"label/{label}/values", **{"match[]": interpolate(selector, chosen)})
    return sorted(values)


def selection(prometheus: Prometheus, picks: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each variable's substituted text: the picked value where `picks` names one, All elsewhere."""
    picks = picks or {}
    chosen: dict[str, str] = {}
    for variable in query_variables():
        name = variable["name"]
        values = variable_values(prometheus, variable, chosen)
        if name in picks:
            assert picks[name] in values, f"${name} offers {values}, not {picks[name]!r}"
            chosen[name] = regex_escape(picks[name])
        elif variable.get("allValue") is not None:
            chosen[name] = variable["allValue"]
        else:
            assert values, f"${name}: no values for {variable['query']}"
            escaped = [regex_escape(v) for v in values]
            chosen[name] = escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"
    return chosen


def panels_without_data(prometheus: Prometheus, timeout: float) -> list[str]:
    """Dashboard queries (every variable at All) that return nothing within `timeout` seconds, all of them."""
    chosen = selection(prometheus)
    pending = {f"{title!r}: {expr}": interpolate(expr, chosen) for title, expr in dashboard_targets()}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        pending = {name: expr for name, expr in pending.items() if not prometheus.query(expr)}
        time.sleep(0.5)
    return sorted(pending)
