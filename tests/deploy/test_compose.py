"""deploy/compose: a real Compose implementation accepts the file, and the files it mounts work where mounted.

Debian's docker-compose (1.29) validates the file against its Compose schema and resolves it, without a
Docker engine. The mounted Prometheus and Grafana files are then laid out under a temporary root exactly as the
bind mounts place them, and checked there: promtool checks the Prometheus config together with the rule files
it finds through its relative path, and the Grafana provisioning must point at the mounted dashboard and at the
Prometheus service.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.helpers import COMPOSE, DASHBOARD, run, tool

SIDECAR = "kv-exporter"


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    """`docker-compose config`: validated, variables interpolated, relative paths made absolute."""
    out = run(tool("docker-compose"), "-f", str(COMPOSE), "config", cwd=COMPOSE.parent)
    config: dict[str, Any] = yaml.safe_load(out)
    return config


def test_compose_config_is_valid() -> None:
    run(tool("docker-compose"), "-f", str(COMPOSE), "config", "--quiet", cwd=COMPOSE.parent)


def test_compose_validation_is_live(tmp_path: Path) -> None:
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"][SIDECAR]["read_only"] = "sometimes"
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    proc = subprocess.run(
        [tool("docker-compose"), "-f", str(path), "config", "--quiet"], capture_output=True, text=True, check=False
    )
    assert proc.returncode != 0 and "read_only" in proc.stderr


def mount(service: dict[str, Any], root: Path) -> None:
    """Copy each bind mount's source to where the container sees it, under `root`."""
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if not source.startswith("/"):
            continue  # a named volume
        assert Path(source).exists(), f"bind mount source {source} missing"
        where = root / target.lstrip("/")
        where.parent.mkdir(parents=True, exist_ok=True)
        if Path(source).is_dir():
            shutil.copytree(source, where, dirs_exist_ok=True)
        else:
            shutil.copy2(source, where)


def test_prometheus_config_and_rules_as_mounted(resolved: dict[str, Any], tmp_path: Path) -> None:
    service = resolved["services"]["prometheus"]
    mount(service, tmp_path)
    config_flag = next(a for a in service["command"] if a.startswith("--config.file="))
    config = tmp_path / config_flag.split("=", 1)[1].lstrip("/")
    out = run(tool("promtool"), "check", "config", str(config))
    # promtool found and checked the rules through the config's relative rule_files path.
    assert "kv-exporter.rules.yml" in out and "SUCCESS" in out
    targets = {
        t
        for job in yaml.safe_load(config.read_text())["scrape_configs"]
        for c in job["static_configs"]
        for t in c["targets"]
    }
    sidecar_port = resolved["services"][SIDECAR]["ports"][0].split(":")[-1].split("/")[0]
    assert f"{SIDECAR}:{sidecar_port}" in targets


def test_grafana_provisioning_as_mounted(resolved: dict[str, Any], tmp_path: Path) -> None:
    mount(resolved["services"]["grafana"], tmp_path)
    provisioning = tmp_path / "etc/grafana/provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards/kv-exporter.yaml").read_text())["providers"]
    folder = tmp_path / provider["options"]["path"].lstrip("/")
    boards = list(folder.glob("*.json"))
    assert [json.loads(b.read_text()) for b in boards] == [json.loads(DASHBOARD.read_text())]


def test_sidecar_service_hardening(resolved: dict[str, Any]) -> None:
    sidecar = resolved["services"][SIDECAR]
    assert sidecar["read_only"] is True
    assert sidecar["user"].split(":")[0] not in ("0", "root")
    assert sidecar["cap_drop"] == ["ALL"]
    assert all(v.endswith(":ro") for v in sidecar["volumes"])
    (device,) = sidecar["deploy"]["resources"]["reservations"]["devices"]
    (engine_device,) = resolved["services"]["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == engine_device["device_ids"], "the sidecar must see the engine's GPU"
    assert "utility" in device["capabilities"]


def test_ports_bound_to_loopback(resolved: dict[str, Any]) -> None:
    for name, service in resolved["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_engine_and_sidecar_share_the_manifest_volume(resolved: dict[str, Any]) -> None:
    engine = resolved["services"]["vllm"]
    sidecar = resolved["services"][SIDECAR]
    folder = engine["environment"]["KV_EXPORTER_DIR"]
    engine_volume = next(v.split(":")[0] for v in engine["volumes"] if v.split(":")[1] == folder)
    sidecar_volume = next(v.split(":")[0] for v in sidecar["volumes"] if v.split(":")[1] == folder)
    assert engine_volume == sidecar_volume and not engine_volume.startswith("/")
    assert f"--manifest-dir={folder}" in sidecar["command"]
    assert "--engine-url=http://vllm:8000/metrics" in sidecar["command"]
