"""Prometheus rules: promtool's own checks and unit tests, and what every alert must carry."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.deploy.helpers import (
    ALERTS_DOC,
    RULES,
    RULES_TEST,
    alerts,
    contract_metrics,
    metrics_in,
    rule_groups,
    run,
    tool,
)

SEVERITIES = {"critical", "warning", "info"}


def test_promtool_check_rules() -> None:
    out = run(tool("promtool"), "check", "rules", str(RULES))
    assert "SUCCESS" in out


def test_promtool_unit_tests() -> None:
    out = run(tool("promtool"), "test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert "SUCCESS" in out


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    """The unit tests compare rendered annotations exactly: a changed threshold must break them."""
    (tmp_path / RULES.name).write_text(RULES.read_text().replace("vector(0.10)", "vector(0.04)"))
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
        for key in ("summary", "description", "runbook"):
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
    ):
        assert metric in by_metric, f"no alert reads {metric}"
    # Headroom below the configurable fraction: through the one recording rule operators edit.
    headroom = [a for a in alerts() if "model_local_kv:headroom_alert_fraction" in a["expr"]]
    assert headroom, "no alert uses model_local_kv:headroom_alert_fraction"


def test_runbooks_exist_in_docs() -> None:
    text = ALERTS_DOC.read_text()
    anchors = {_github_anchor(h) for h in re.findall(r"^#+\s+(.+)$", text, flags=re.M)}
    for alert in alerts():
        path, _, anchor = alert["annotations"]["runbook"].partition("#")
        assert path == "docs/alerts.md"
        assert anchor in anchors, f"{alert['alert']}: docs/alerts.md has no section #{anchor}"
        section = text.split(f"## {alert['alert']}", 1)[-1].split("\n## ", 1)[0]
        for part in ("Meaning", "Impact", "Diagnosis", "Mitigation"):
            assert f"**{part}**" in section, f"{alert['alert']}: runbook lacks {part}"


def _github_anchor(heading: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_rules_read_only_contract_metrics() -> None:
    known = contract_metrics()
    for group in rule_groups():
        for rule in group["rules"]:
            unknown = metrics_in(rule["expr"]) - known
            assert not unknown, f"{rule.get('alert') or rule.get('record')}: {unknown} not in docs/CONTRACTS.md"
