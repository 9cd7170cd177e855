"""The sidecar Component (deploy/kubernetes/components/sidecar) on engines of any shape, rendered by kubectl kustomize:
a Deployment and a StatefulSet whose engine container is `engine`, a KServe-shaped pod (`kserve-container` beside
KServe's agent), and a workload that does not name its engine container.

Today's main patched a container named `vllm` only: on any other it rendered without error and added an image-less
`vllm` container, leaving the real engine without the manifest folder, and it ignored an annotated StatefulSet.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from tests.deploy.helpers import DEPLOY, kubectl, kustomize

COMPONENT = DEPLOY / "kubernetes/components/sidecar"
SIDECAR = "kv-exporter"
FOLDER = "/run/kv-exporter"
ENABLED = {"kv-exporter/sidecar": "enabled"}


def workload(kind: str, name: str, containers: list[str], annotations: dict[str, str]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"app": name}},
        "template": {
            "metadata": {"labels": {"app": name}},
            "spec": {"containers": [{"name": c, "image": f"registry.example.com/{c}:1"} for c in containers]},
        },
    }
    if kind == "StatefulSet":
        spec["serviceName"] = name
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name, "annotations": annotations}, "spec": spec}


def render(tmp_path: Path, *workloads: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "workloads.yaml").write_text(yaml.safe_dump_all(workloads))
    kustomization = {"resources": ["workloads.yaml"], "components": [os.path.relpath(COMPONENT, tmp_path)]}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return subprocess.run([kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, check=False)


def pod_of(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["metadata"]["name"] == name and d["kind"] != "PodMonitor"]
    kubernetes_validate.validate(found, kubernetes_validate.latest_version(), strict=True)
    pod: dict[str, Any] = found["spec"]["template"]
    return pod


def check_engine(pod: dict[str, Any], engine: str, others: list[str]) -> None:
    """The engine container has the folder and the variables, and reads its own name from the pod; nothing image-less
    was added; the sidecar follows the workload's containers and kubectl defaults to the engine."""
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    assert list(containers) == [*others, SIDECAR] and all(c.get("image") for c in containers.values())
    annotations = pod["metadata"]["annotations"]
    assert annotations["kv-exporter/engine-container"] == engine
    assert annotations["kubectl.kubernetes.io/default-container"] == engine
    env = {e["name"]: e for e in containers[engine]["env"]}
    assert env["KV_EXPORTER_DIR"]["value"] == FOLDER
    assert {m["name"]: m["mountPath"] for m in containers[engine]["volumeMounts"]}["kv-manifests"] == FOLDER
    name_path = env["KV_EXPORTER_CONTAINER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert name_path == "metadata.annotations['kv-exporter/engine-container']"
    assert env["KV_EXPORTER_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["KV_EXPORTER_POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert f"--manifest-dir={FOLDER}" in containers[SIDECAR]["args"]
    assert pod["metadata"]["labels"]["kv-exporter/sidecar"] == "enabled"  # what the PodMonitor selects
    assert pod["spec"]["shareProcessNamespace"] is True


@pytest.mark.parametrize("kind", ["Deployment", "StatefulSet"])
def test_an_engine_container_of_any_name_in_a_deployment_or_a_statefulset(tmp_path: Path, kind: str) -> None:
    named = {**ENABLED, "kv-exporter/engine-container": "engine"}
    untouched = workload(kind, "router", ["router"], {})
    done = render(tmp_path, workload(kind, "llm", ["engine"], named), untouched)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    check_engine(pod_of(docs, "llm"), "engine", ["engine"])
    assert pod_of(docs, "router") == untouched["spec"]["template"]


def test_a_kserve_shaped_pod(tmp_path: Path) -> None:
    """KServe's predictor pods name the engine `kserve-container` (its agent runs beside it)."""
    named = {**ENABLED, "kv-exporter/engine-container": "kserve-container"}
    done = render(tmp_path, workload("Deployment", "isvc-predictor", ["kserve-container", "agent"], named))
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    check_engine(pod_of(docs, "isvc-predictor"), "kserve-container", ["kserve-container", "agent"])


def test_a_workload_that_does_not_name_its_engine_container_fails_the_render(tmp_path: Path) -> None:
    done = render(tmp_path, workload("StatefulSet", "llm", ["kserve-container"], ENABLED))
    assert done.returncode != 0
    assert "kv-exporter/engine-container" in done.stderr, done.stderr


def test_the_shipped_example_names_its_engine_container() -> None:
    docs = kustomize(DEPLOY / "kubernetes/examples/own-engine")
    check_engine(pod_of(docs, "my-llm"), "vllm", ["vllm", "auth-proxy"])
