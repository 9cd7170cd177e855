"""Alerts through a scrape gap (a Prometheus stall, a failed scrape): promtool runs the shipped rules on series with
two failed scrapes in them, as Prometheus stores them (a staleness marker, then nothing).

Each alert holds in the way docs/alerts.md's table says ("Scrape gaps and restarts"):
- `last 5m`: it reads the last value within 5 minutes (`last_over_time`), so a gap while it waits neither restarts its
  `for` nor, while it fires, resolves it; a fix resolves it at the next scrape;
- `keeps 5m`: it keeps firing 5 minutes past a gap (`keep_firing_for`); a gap while it waits restarts its `for`;
- `10m window`: it reads a counter's increase over 10 minutes (`for: 0m`), which spans a gap;
- `absent`: `absent(up)`, which a gap can only make fire.

Today's main restarted every `for` after a gap: two failed scrapes kept the invalid-manifest alert quiet for 9.5
minutes while the bad file stayed. The annotations are left out of the rules here (promtool compares their text);
kv-exporter.rules.test.yml shows them, with the invalid-manifest alert through a gap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.helpers import ALERTS_DOC, alerts, run, tool, write_rules_without_annotations

TARGET = {"job": "kv-exporter", "instance": "pod-a:9477"}
ENGINE = {"model_name": "tts", "stage": "0", "engine": "0", "pod": "tts-0", "namespace": "serving"}
OWNER = {**ENGINE, "gpu": "0", "UUID": "GPU-0"}
GAP = ["stale", "_"]  # two failed scrapes: Prometheus writes a staleness marker at the first, nothing at the second


@dataclass(frozen=True)
class Case:
    """Series that set the alert off (`bad`) and, where one exists, the values that fix it (`good`)."""

    series: dict[str, tuple[float, float | None]]  # selector -> (bad, good)
    by: tuple[str, ...] | None = None  # the labels an aggregating alert keeps (None: every label of the series)


def selector(name: str, **labels: str) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in {**TARGET, **labels}.items()) + "}"


CASES: dict[str, Case] = {
    "ModelLocalKVEnginePageUnreadable": Case(
        {selector("model_local_kv_engine_page_up", target="http://127.0.0.1:8000/metrics"): (0, 1)}
    ),
    "ModelLocalKVEngineUnreadable": Case({selector("model_local_kv_engine_up", **ENGINE): (0, 1)}),
    "ModelLocalKVNVMLUnavailable": Case({selector("model_local_kv_nvml_up"): (0, 1)}),
    "ModelLocalKVManifestsMissing": Case({selector("model_local_kv_engine_manifests", **ENGINE): (0, 1)}),
    "ModelLocalKVManifestInvalid": Case({selector("model_local_kv_manifests", state="invalid"): (2, 0)}),
    "ModelLocalKVManifestsStale": Case({selector("model_local_kv_manifests", state="stale"): (1, 0)}),
    "ModelLocalKVManifestFolderUnusable": Case(
        {
            selector("model_local_kv_manifest_folder_state", state="missing"): (1, 0),
            selector("model_local_kv_manifest_folder_state", state="ok"): (0, 1),
        }
    ),
    "ModelLocalKVObservationUnavailable": Case(
        {
            selector("model_local_kv_observation_state", **ENGINE, state="failing"): (1, 0),
            selector("model_local_kv_observation_state", **ENGINE, state="ok"): (0, 1),
        }
    ),
    "ModelLocalKVExporterDown": Case({selector("up"): (0, 1)}),
    # One alert per GPU, whichever exporters see it: each target here sees a GPU of its own (UUID after it).
    "ModelLocalKVGPUNotProjected": Case(
        {selector("model_local_kv_gpu_other_processes", gpu="0", UUID=f"GPU-{TARGET['instance']}"): (2, 0)},
        by=("UUID", "gpu"),
    ),
    "ModelLocalKVOwnerExceedsDeclaration": Case(
        {
            selector("model_local_kv_unexplained_bytes", **OWNER, owner="decoder"): (100, 0),
            selector(
                "model_local_kv_ceiling_bytes", **OWNER, owner="decoder", cache="k", scope="request", driver="fixed"
            ): (1000, 1000),
        }
    ),
    "ModelLocalKVUndeclaredCache": Case(
        {selector("model_local_kv_observed_peak_bytes", **OWNER, owner="vocoder"): (4096, 0)}
    ),
    "ModelLocalKVDeclaredNeverAllocated": Case(
        {
            selector("model_local_kv_observed_peak_bytes", **OWNER, owner="encoder"): (0, 4096),
            selector(
                "model_local_kv_ceiling_bytes",
                **OWNER,
                owner="encoder",
                cache="k",
                scope="request",
                driver="max_num_seqs",
            ): (1000, 1000),
            selector("model_local_kv_running_sequences", **ENGINE): (2, 2),
        }
    ),
}
# Their expressions are issue 38's (thresholds, one series per GPU): only `keep_firing_for` is checked for them here.
HEADROOM_ALERTS = {"ModelLocalKVProjectedPeakAboveGPUMemory", "ModelLocalKVHeadroomLow"}


def minutes(duration: str) -> int:
    match = re.fullmatch(r"(\d+)m", duration)
    assert match, duration
    return int(match.group(1))


def strategy(alert: dict[str, Any]) -> str:
    """How an alert holds through a gap, read from the rule as docs/alerts.md names it."""
    expr = alert["expr"]
    if "keep_firing_for" in alert:
        assert "last_over_time" not in expr, alert["alert"]
        return f"keeps {alert['keep_firing_for']}"
    if window := re.findall(r"\blast_over_time\(.*?\[(\w+)\]\)", expr):
        assert len(set(window)) == 1, alert["alert"]
        return f"last {window[0]}"
    if window := re.findall(r"\bincrease\(.*?\[(\w+)\]\)", expr):
        assert alert["for"] == "0m", f"{alert['alert']}: a window with a `for` would restart after a gap"
        return f"{window[0]} window"
    if expr.startswith("absent("):
        return "absent"
    return "none"


def test_every_alert_holds_through_a_gap_as_docs_alerts_md_says() -> None:
    rows = re.findall(r"^\| (ModelLocalKV\w+) \| \w+ \| \w+ \| ([^|]+?) \|", ALERTS_DOC.read_text(), flags=re.M)
    documented = dict(rows)
    shipped = {a["alert"]: strategy(a) for a in alerts()}
    assert "none" not in shipped.values(), shipped
    assert documented == shipped
    assert set(CASES) | HEADROOM_ALERTS == {
        name for name, how in shipped.items() if how.startswith(("last", "keeps"))
    }, "every alert with a `for` is run through a gap below"


def values(*tokens: str | float) -> str:
    return " ".join(token if isinstance(token, str) else f"{token:g}" for token in tokens)


def run_promtool(tmp_path: Path, series: list[dict[str, str]], checks: list[dict[str, Any]]) -> None:
    rule_file = write_rules_without_annotations(tmp_path)
    test = {
        "rule_files": [rule_file],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}],
    }
    (tmp_path / "gaps.test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    run(tool("promtool"), "test", "rules", "gaps.test.yml", cwd=tmp_path)


def alert_labels(alert: dict[str, Any], instance: str) -> dict[str, str]:
    """The labels the alert fires with: its own, and those of the case's first series (the one it is about)."""
    case = CASES[alert["alert"]]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', on_instance(next(iter(case.series)), instance)))
    kept = labels if case.by is None else {name: labels[name] for name in case.by}
    return {**alert["labels"], **kept}


def on_instance(selector_text: str, instance: str) -> str:
    return selector_text.replace(TARGET["instance"], instance)


def firing(how: str, hold: int, instance: str, at: int) -> bool:
    """Whether the alert fires at minute `at` for each target of the test below. The minutes checked keep a minute
    clear of every boundary: an alert on a recording rule may start a minute late (promtool may evaluate the group
    that records it after the alert's at a given minute)."""
    if instance == "waits":  # a gap while waiting restarts a `for` unless the alert reads the last value
        return at >= (hold if how.startswith("last") else hold + 6)
    if instance == "fires":
        return at >= hold
    fixed_at = hold + 2  # "fixed"
    return hold <= at < (fixed_at if how.startswith("last") else fixed_at + 4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_two_scrape_gap_changes_nothing_it_should_not(tmp_path: Path, name: str) -> None:
    """Three targets, each set off from minute 0: `waits` has its gap while the alert waits (minutes 2-3), `fires`
    while it fires (minutes F+2 and F+3, F its `for`), `fixed` is fixed at minute F+2. An alert that reads the last
    value fires on time for `waits`, through the gap for `fires`, and resolves at once for `fixed`; one that keeps
    firing does so through the gap for `fires` and for 5 minutes after `fixed` (and fires for `waits` a `for` after
    the gap)."""
    (alert,) = [a for a in alerts() if a["alert"] == name]
    how, hold = strategy(alert), minutes(alert["for"])
    assert how in ("last 5m", "keeps 5m"), how
    series = []
    for selector_text, (bad, good) in CASES[name].series.items():
        fixed = bad if good is None else good
        series += [
            {"series": on_instance(selector_text, "waits"), "values": values(bad, bad, *GAP, *[bad] * (hold + 12))},
            {"series": on_instance(selector_text, "fires"), "values": values(*[bad] * (hold + 2), *GAP, *[bad] * 10)},
            {"series": on_instance(selector_text, "fixed"), "values": values(*[bad] * (hold + 2), *[fixed] * 10)},
        ]
    checks = [
        {
            "eval_time": f"{at}m",
            "alertname": name,
            "exp_alerts": [
                {"exp_labels": alert_labels(alert, instance)}
                for instance in ("waits", "fires", "fixed")
                if firing(how, hold, instance, at)
            ],
        }
        for at in (hold + 1, hold + 2, hold + 3, hold + 8, hold + 9)
    ]
    run_promtool(tmp_path, series, checks)


@pytest.mark.parametrize("name", sorted(HEADROOM_ALERTS))
def test_the_headroom_alerts_keep_firing_through_a_gap(name: str) -> None:
    (alert,) = [a for a in alerts() if a["alert"] == name]
    assert alert.get("keep_firing_for") == "5m"
