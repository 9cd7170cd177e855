"""Prometheus rules: promtool's own checks and unit tests, and what every alert must carry."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.generate import RUNBOOK_BASE, RUNBOOK_FILES, rebase_runbooks
from kv_exporter.sidecar.thresholds import (
    HEADROOM_MARGIN_FRACTION,
    UNEXPLAINED_ALERT_FRACTION,
    HeadroomState,
    headroom_state,
)
from tests.deploy.helpers import (
    ALERTS_DOC,
    RULES,
    RULES_TEST,
    THRESHOLDS_EXAMPLE,
    THRESHOLDS_TEST,
    alerts,
    contract_metrics,
    metrics_in,
    rule_groups,
    run,
    tool,
    write_rules_without_annotations,
)

SEVERITIES = {"critical", "warning", "info"}


DEFAULT_RULE = "model_local_kv:headroom_margin_fraction:default"
OVERRIDE_RULE = "model_local_kv:headroom_margin_fraction:override"


@pytest.mark.parametrize("path", [RULES, THRESHOLDS_EXAMPLE], ids=lambda p: p.name)
def test_promtool_check_rules(path: Path) -> None:
    out = run(tool("promtool"), "check", "rules", str(path))
    assert "SUCCESS" in out


@pytest.mark.parametrize("path", [RULES_TEST, THRESHOLDS_TEST], ids=lambda p: p.name)
def test_promtool_unit_tests(path: Path) -> None:
    out = run(tool("promtool"), "test", "rules", path.name, cwd=path.parent)
    assert "SUCCESS" in out


def recorded(path: Path) -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"] if "record" in r]


@pytest.mark.parametrize(
    ("rule", "constant"),
    [
        (DEFAULT_RULE, HEADROOM_MARGIN_FRACTION),
        ("model_local_kv:unexplained_alert_fraction:default", UNEXPLAINED_ALERT_FRACTION),
    ],
)
def test_landing_page_default_is_the_shipped_one(rule: str, constant: float) -> None:
    """One number in two files (the rules and the package the landing page reads): they must agree."""
    (default,) = [r for r in recorded(RULES) if r["record"] == rule]
    match = re.fullmatch(r"vector\(([0-9.]+)\)", default["expr"])
    assert match, default["expr"]
    assert float(match.group(1)) == constant


def test_overrides_never_write_a_shipped_series() -> None:
    """An operator's file records only the override series, which no shipped rule writes: no duplicate samples."""
    shipped = {r["record"] for r in recorded(RULES)}
    assert OVERRIDE_RULE not in shipped
    example = recorded(THRESHOLDS_EXAMPLE)
    assert example and {r["record"] for r in example} == {OVERRIDE_RULE}
    scopes = [tuple(sorted(r.get("labels", {}))) for r in example]
    assert len(scopes) == len(set(scopes)) == 4, scopes  # one rule per scope: every scope shown, none twice


# Headroom to the binding limit, at and around each boundary of the shipped alerts, with 4 GiB declared on the GPU
# (the margin: 5 % of it, 204.8 MiB), and a GPU with nothing declared (no margin: only the critical alert).
CEILING = 4 * 2**30
MARGIN = 214748364.8
AGREEMENT = [
    (-1, CEILING),
    (0, CEILING),
    (1, CEILING),
    (214748364, CEILING),
    (214748365, CEILING),
    (8 * 2**30, CEILING),
    (0, 0),
    (-1, 0),
]
TOTAL = 80 * 2**30
STATE_ALERT = {
    HeadroomState.LOW: "ModelLocalKVHeadroomLow",
    HeadroomState.OVER: "ModelLocalKVProjectedPeakAboveGPUMemory",
}


def test_headroom_state_agrees_with_the_shipped_alerts(tmp_path: Path) -> None:
    """What the landing page colours a GPU is what the shipped alerts do with it: promtool evaluates the shipped
    expressions on GPUs at each boundary and expects the alerts `headroom_state` names (annotations left out of the
    copy, since only the expressions are compared). The limit is a worker's cap below the GPU's total for half of
    them: the alerts read the headroom to it, not to the total."""
    assert 214748364 < MARGIN < 214748365
    rule_file = write_rules_without_annotations(tmp_path)
    series, expected = [], {name: [] for name in STATE_ALERT.values()}
    states = set()
    for gpu, (headroom, ceiling) in enumerate(AGREEMENT):
        labels = {
            "job": "kv-exporter",
            "instance": "node:9477",
            "gpu": str(gpu),
            "UUID": f"GPU-{gpu}",
            "source": "nvml",
        }
        limit = TOTAL if gpu % 2 else TOTAL - 10 * 2**30
        selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for metric, value in (
            ("model_local_kv_gpu_memory_total_bytes", TOTAL),
            ("model_local_kv_gpu_limit_bytes", limit),
            ("model_local_kv_gpu_projected_peak_bytes", limit - headroom),
            ("model_local_kv_gpu_headroom_bytes", headroom),
            ("model_local_kv_gpu_declared_ceiling_bytes", ceiling),
        ):
            series.append({"series": f"{metric}{{{selector}}}", "values": f"{value}x20"})
        state = headroom_state(headroom, ceiling)
        states.add(state)
        if state in STATE_ALERT:
            severity = "warning" if state is HeadroomState.LOW else "critical"
            expected[STATE_ALERT[state]].append({"exp_labels": {**labels, "severity": severity}})
    assert states == set(HeadroomState), "the boundaries must reach every state"
    cases = [{"eval_time": "11m", "alertname": name, "exp_alerts": alerts} for name, alerts in expected.items()]
    test = {
        "rule_files": [rule_file],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": cases}],
    }
    (tmp_path / "agreement.test.yml").write_text(yaml.safe_dump(test))
    run(tool("promtool"), "test", "rules", "agreement.test.yml", cwd=tmp_path)


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    """The unit tests compare rendered annotations exactly: a changed threshold must break them."""
    shipped = RULES.read_text()
    margin = "      - record: model_local_kv:headroom_margin_fraction:default\n        expr: vector(0.05)"
    assert shipped.count(margin) == 1
    (tmp_path / RULES.name).write_text(shipped.replace(margin, margin.replace("0.05", "0.01")))
    (tmp_path / RULES_TEST.name).write_text(RULES_TEST.read_text())
    proc = subprocess.run(
        [tool("promtool"), "test", "rules", RULES_TEST.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0
    assert "ModelLocalKVHeadroomLow" in proc.stdout + proc.stderr


def test_every_alert_fires_and_stays_silent_in_the_unit_tests() -> None:
    cases = [case for test in yaml.safe_load(RULES_TEST.read_text())["tests"] for case in test["alert_rule_test"]]
    for alert in alerts():
        name = alert["alert"]
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case["exp_alerts"] for case in mine), f"{name} is never shown firing"
        assert any(not case["exp_alerts"] for case in mine), f"{name} is never shown silent"


def test_alerts_carry_for_severity_and_annotations() -> None:
    for alert in alerts():
        name = alert["alert"]
        assert "for" in alert, f"{name}: no `for`"
        assert alert["labels"]["severity"] in SEVERITIES, name
        for key in ("summary", "description", "runbook_url"):
            assert alert["annotations"].get(key, "").strip(), f"{name}: no {key}"


def test_issue_alerts_exist() -> None:
    """The alerts issue 5 asks for, by the metric each reads."""
    by_metric: dict[str, list[str]] = {}
    for alert in alerts():
        for metric in metrics_in(alert["expr"]) | set(re.findall(r"\bup\b", alert["expr"])):
            by_metric.setdefault(metric, []).append(alert["alert"])
    for metric in (
        "model_local_kv_gpu_projected_peak_bytes",  # projected peak above the GPU's memory
        "model_local_kv_engine_page_up",  # engine unreadable
        "model_local_kv_engine_up",
        "model_local_kv_nvml_up",  # NVML unavailable
        "model_local_kv_engine_manifests",  # manifests missing for a running engine
        "model_local_kv_manifest_errors_total",  # manifest errors increasing
        "up",  # exporter down
        "model_local_kv_observed_peak_bytes",  # held KV declaring nothing; declared rows per sequence, never allocated
        "model_local_kv_observation_state",  # observation off or failing: never a silent absence
    ):
        assert metric in by_metric, f"no alert reads {metric}"
    # Headroom below the margin in force: the shipped default unless an operator's override applies.
    by_record = {r["record"]: r for r in recorded(RULES)}
    effective = by_record["gpu:model_local_kv_headroom_margin_fraction:effective"]
    assert DEFAULT_RULE in effective["expr"] and OVERRIDE_RULE in effective["expr"]
    margin = by_record["gpu:model_local_kv_headroom_margin:bytes"]
    assert effective["record"] in margin["expr"] and "model_local_kv_gpu_declared_ceiling_bytes" in margin["expr"]
    headroom = [a for a in alerts() if margin["record"] in a["expr"]]
    assert [a["alert"] for a in headroom] == ["ModelLocalKVHeadroomLow"]
    # The critical alert reads the limit met first, not the GPU's total.
    (critical,) = [a for a in alerts() if a["alert"] == "ModelLocalKVProjectedPeakAboveGPUMemory"]
    assert "model_local_kv_gpu_limit_bytes" in metrics_in(critical["expr"])
    # An owner holding more than it declared, beyond the tolerance in force: recorded from the unexplained bytes.
    (ratio,) = [r for r in recorded(RULES) if r["record"] == "owner:model_local_kv_unexplained:ratio"]
    assert "model_local_kv_unexplained_bytes" in metrics_in(ratio["expr"])
    exceeds = [a["alert"] for a in alerts() if ratio["record"] in a["expr"]]
    assert exceeds == ["ModelLocalKVOwnerExceedsDeclaration"]


def test_runbooks_exist_in_docs() -> None:
    text = ALERTS_DOC.read_text()
    anchors = {_github_anchor(h) for h in re.findall(r"^#+\s+(.+)$", text, flags=re.M)}
    for alert in alerts():
        url = alert["annotations"]["runbook_url"]
        assert url == f"{RUNBOOK_BASE}#{alert['alert'].lower()}", f"{alert['alert']}: {url}"
        assert url.partition("#")[2] in anchors, f"{alert['alert']}: docs/alerts.md has no section for {url}"
        section = text.split(f"## {alert['alert']}\n", 1)[-1].split("\n## ", 1)[0]
        for part in ("Meaning", "Impact", "Diagnosis", "Mitigation"):
            assert f"**{part}**" in section, f"{alert['alert']}: runbook lacks {part}"
    assert f"`{RUNBOOK_BASE}#" in text, "docs/alerts.md must name the shipped runbook base"


def test_runbook_base_can_be_changed() -> None:
    """`--runbook-base` moves every runbook_url, in the rules and in the promtool tests that render them, to one new
    base with the same anchors, and changes nothing else."""
    base = "https://wiki.example/ops/kv-exporter"
    for path in RUNBOOK_FILES:
        text = path.read_text()
        moved = rebase_runbooks(text, base + "/")
        shipped = text.count(f"runbook_url: {RUNBOOK_BASE}#")
        assert shipped and moved.count(f"runbook_url: {base}#") == shipped, path.name
        assert RUNBOOK_BASE not in moved and "runbook:" not in moved, path.name
        assert moved.replace(base, RUNBOOK_BASE) == text, path.name


def test_alerts_table_lists_every_alert() -> None:
    """docs/alerts.md's table names each shipped alert once, with its severity and `for`."""
    rows = re.findall(r"^\| (ModelLocalKV\w+) \| (\w+) \| (\w+) \|", ALERTS_DOC.read_text(), flags=re.M)
    shipped = [(a["alert"], a["labels"]["severity"], a["for"]) for a in alerts()]
    assert sorted(rows) == sorted(shipped)


def test_invalid_manifest_alert_lasts_while_the_file_stays() -> None:
    """Beside the error-rate alert, one reads the invalid-manifest gauge itself, so it fires for as long as a file
    stays bad; the promtool tests show it firing after the error alert has resolved, for a file there before the
    exporter started and for one that appeared later, and resolving once the file is removed."""
    by_name = {a["alert"]: a for a in alerts()}
    assert "increase(model_local_kv_manifest_errors_total" in by_name["ModelLocalKVManifestErrors"]["expr"]
    (invalid,) = [a for a in alerts() if 'model_local_kv_manifests{state="invalid"}' in a["expr"]]
    # A window on the error counter would let it go quiet; the gauge's last value within 5 minutes holds it through
    # a scrape gap (tests/deploy/test_rule_gaps.py) and no longer.
    assert "increase" not in invalid["expr"] and "offset" not in invalid["expr"], "a window would let it go quiet"
    cases = [case for test in yaml.safe_load(RULES_TEST.read_text())["tests"] for case in test["alert_rule_test"]]
    quiet = {c["eval_time"] for c in cases if c["alertname"] == "ModelLocalKVManifestErrors" and not c["exp_alerts"]}
    late = [c for c in cases if c["alertname"] == invalid["alert"] and c["eval_time"] in quiet and c["exp_alerts"]]
    assert late, "never shown firing while the error alert is quiet"
    instances = {a["exp_labels"]["instance"] for c in late for a in c["exp_alerts"]}
    assert {"pod-a:9477", "pod-b:9477"} <= instances  # appeared later; there before the exporter started


def test_records_keep_every_label_but_those_they_sum_away() -> None:
    """`sum by (job, instance, ...)` dropped `cluster`, `namespace` and `pod`: under a global ruler (Thanos, Mimir)
    two clusters' engines merged. Every recording rule that sums says what it sums away; the promtool tests record
    two clusters' engines apart (kv-exporter.rules.test.yml)."""
    for rule in recorded(RULES):
        summed = re.findall(r"\bsum\s*(by|without)?\s*\(", rule["expr"])
        assert all(how == "without" for how in summed), f"{rule['record']}: {rule['expr']}"


def _github_anchor(heading: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_rules_read_only_contract_metrics() -> None:
    known = contract_metrics()
    for group in rule_groups():
        for rule in group["rules"]:
            unknown = metrics_in(rule["expr"]) - known
            assert not unknown, f"{rule.get('alert') or rule.get('record')}: {unknown} not in docs/CONTRACTS.md"
