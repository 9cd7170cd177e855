"""Shared helpers for the deploy checks: repo paths, system tools, rendered manifests, a real Prometheus."""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.constants import REPO
from tests.support.net import free_port
from tests.support.scrape import parse
from tests.support.sidecar import stop_process

DEPLOY = REPO / "deploy"
KUSTOMIZE_ROOTS = [
    DEPLOY / "kubernetes/base",
    *sorted(p for p in (DEPLOY / "kubernetes/overlays").iterdir() if p.is_dir()),
]
RULES = DEPLOY / "prometheus/kv-exporter.rules.yml"
RULES_TEST = DEPLOY / "prometheus/kv-exporter.rules.test.yml"
THRESHOLDS_EXAMPLE = DEPLOY / "prometheus/kv-exporter.thresholds.example.yml"
THRESHOLDS_TEST = DEPLOY / "prometheus/kv-exporter.thresholds.test.yml"
DASHBOARD = REPO / "dashboards/kv-exporter.json"
COMPOSE = DEPLOY / "compose/compose.yaml"
COMPOSE_PROMETHEUS = DEPLOY / "compose/prometheus.yml"
CONTRACTS = REPO / "docs/CONTRACTS.md"
ALERTS_DOC = REPO / "docs/alerts.md"
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """A command the deploy checks need; they are installed by `make test` (system-deps, .venv)."""
    found = shutil.which(name) or shutil.which(name, path=str(VENV_BIN))
    if found is None:
        pytest.fail(f"{name} not found: run `make system-deps` (Debian packages) or `make .venv/.installed`")
    return found


def run(*cmd: str, cwd: Path = REPO, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    """Run a command; fail the test with its output when it exits non-zero."""
    proc = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


# The kustomizations use `labels`, `patches`, components and generator options: kustomize v4 or newer (kubectl
# 1.21+). Debian bookworm's kubernetes-client (1.20, kustomize v2.0.3) is too old for them.
MIN_KUSTOMIZE = (4, 0)


def kubectl() -> str:
    path = tool("kubectl")
    info = json.loads(run(path, "version", "--client", "-o", "json"))
    found = info.get("kustomizeVersion", "v0.0")
    if tuple(int(x) for x in re.findall(r"\d+", found)[:2]) < MIN_KUSTOMIZE:
        pytest.fail(f"{path} bundles kustomize {found}; these checks need v{MIN_KUSTOMIZE[0]} or newer")
    return path


def kustomize(root: Path) -> list[dict[str, Any]]:
    out = run(kubectl(), "kustomize", str(root))
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def contract_metrics() -> set[str]:
    """Metric names pinned in docs/CONTRACTS.md (the single source for names outside Python code)."""
    text = CONTRACTS.read_text()
    section = text[text.index("## Metrics contract") :]
    return set(re.findall(r"`(model_local_kv_[a-z_]+)[`{]", section))


METRIC_RE = re.compile(r"\b(model_local_kv_[a-z_]+)\b")


def metrics_in(expr: str) -> set[str]:
    """model_local_kv_* names an expression reads (recording-rule names carry colons and are not matched)."""
    return {m for m in METRIC_RE.findall(expr) if not expr.split(m)[0].endswith(":")}


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return groups


def alerts() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"] if "alert" in r]


def write_rules_without_annotations(folder: Path) -> str:
    """The shipped rules, annotations left out, as RULES.name in `folder` (its file name): for promtool tests of the
    expressions alone (promtool compares every annotation of a firing alert). Returns the file name."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (folder / RULES.name).write_text(yaml.safe_dump(rules))
    return RULES.name


def series_selector(name: str, labels: dict[str, str]) -> str:
    escaped = (value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for value in labels.values())
    return name + "{" + ",".join(f'{key}="{value}"' for key, value in zip(labels, escaped, strict=True)) + "}"


def held_for(value: float, minutes: int) -> str:
    """`value` held for `minutes` in promtool's notation, in fixed point (its `a+bxn` would misread 1e+20)."""
    assert math.isfinite(value), value
    text = str(int(value)) if value.is_integer() else f"{value:.12f}".rstrip("0")
    return f"{text}x{minutes}"


def page_series(page: str, target: dict[str, str], minutes: int) -> list[dict[str, str]]:
    """Every sample of an exporter's page as Prometheus stores it from the scrape `target` (its `job` and `instance`),
    empty labels dropped (as Prometheus drops them at ingestion), held constant for `minutes`: promtool input."""
    stored = (
        ({**{k: v for k, v in labels if v}, **target}, name, value)
        for (name, labels), value in sorted(parse(page).items())
    )
    return [
        {"series": series_selector(name, labels), "values": held_for(value, minutes)} for labels, name, value in stored
    ]


def dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return board


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel."""
    return [(panel["title"], target["expr"]) for panel in dashboard()["panels"] for target in panel.get("targets", [])]


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError as exc:
            last = exc
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer in {timeout}s: {last}")


@dataclass
class Prometheus:
    """A real Prometheus (Debian's) on a loopback port with a temporary data folder."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"] if data["resultType"] == "vector" else []
        return result

    def wait_for(self, expr: str, timeout: float, what: str = "") -> list[dict[str, Any]]:
        """Poll an instant query until it returns at least one series."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            time.sleep(0.5)
        pytest.fail(f"no data for {what or expr} within {timeout}s")

    def firing(self, alertname: str) -> list[dict[str, Any]]:
        alerts_now: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return [a for a in alerts_now if a["labels"]["alertname"] == alertname and a["state"] == "firing"]


def prometheus_config(targets: list[str], interval: str = "1s") -> dict[str, Any]:
    """The compose stack's prometheus.yml with its kv-exporter targets replaced and a fast interval."""
    config: dict[str, Any] = yaml.safe_load(COMPOSE_PROMETHEUS.read_text())
    config["global"] = {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval}
    jobs = [job for job in config["scrape_configs"] if job["job_name"] == "kv-exporter"]
    assert len(jobs) == 1, "deploy/compose/prometheus.yml must have one kv-exporter job"
    jobs[0]["static_configs"] = [{"targets": targets}]
    config["scrape_configs"] = jobs
    return config


@contextlib.contextmanager
def start_prometheus(workdir: Path, config: dict[str, Any], rules: dict[str, str]) -> Iterator[Prometheus]:
    """Start Prometheus with `config` and the rule files {name: text}, written into workdir/rules/ where the
    compose config's relative rule_files pattern finds them; stop it (by pid) afterwards."""
    (workdir / "rules").mkdir(parents=True, exist_ok=True)
    for name, text in rules.items():
        (workdir / "rules" / name).write_text(text)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    run(tool("promtool"), "check", "config", str(config_path))
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/-/ready", 60, proc)
        yield Prometheus(url, proc, log)
    finally:
        stop_process(proc)
