"""deploy/kubernetes: every kustomization renders offline and validates, CRDs included; the pod wiring holds.

Built-in kinds are validated by kubernetes-validate (bundled Kubernetes OpenAPI schemas, strict: unknown fields
fail). The Prometheus Operator kinds (PodMonitor, ServiceMonitor, PrometheusRule) are not in that bundle; they
are validated with cloudcoil-models-prometheus-operator, pydantic models generated from prometheus-operator
v0.80.1's CRD schemas (types, enums, patterns such as durations). Those models ignore unknown fields, so the
check also re-dumps each resource and requires it to equal the input: a misspelt field disappears and fails.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as monitoring_v1

from tests.deploy.helpers import DASHBOARD, KUSTOMIZE_ROOTS, RULES, find, kustomize, rule_groups

# The newest schemas in the bundle and an older, still common cluster version.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CRD_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
MONITORING = "monitoring.coreos.com/v1"
SIDECAR = "kv-exporter"
ENGINE = "vllm"
EXPORTER_PORT = 9477

ROOT_IDS = [str(p.relative_to(p.parents[1])) for p in KUSTOMIZE_ROOTS]


@pytest.fixture(scope="module", params=KUSTOMIZE_ROOTS, ids=ROOT_IDS)
def rendered(request: pytest.FixtureRequest) -> tuple[Path, list[dict[str, Any]]]:
    root: Path = request.param
    return root, kustomize(root)


def validate_crd(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == MONITORING, doc["apiVersion"]
    model = getattr(monitoring_v1, doc["kind"])
    parsed = model.model_validate(doc)
    again = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert again == doc, f"{doc['kind']} {doc['metadata']['name']}: fields unknown to the CRD schema"


def validate_builtin(doc: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def validate(doc: dict[str, Any]) -> None:
    if doc["kind"] in CRD_KINDS:
        validate_crd(doc)
    else:
        validate_builtin(doc)


def test_every_kustomization_validates(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    assert docs
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("Deployment", ["spec", "template", "spec", "containers", 0, "securityContxt"], {}),
        ("Deployment", ["spec", "replicas"], "one"),
        ("PodMonitor", ["spec", "podMetricEndpoints"], []),
        ("PodMonitor", ["spec", "podMetricsEndpoints", 0, "interval"], "15 seconds"),
        ("PrometheusRule", ["spec", "groups", 2, "rules", 0, "for"], "five minutes"),
    ],
)
def test_validation_rejects_broken_resources(kind: str, path: list[Any], value: Any) -> None:
    """The validators are live: a misspelt field or a wrong type in a rendered resource fails."""
    doc = copy.deepcopy(find(kustomize(KUSTOMIZE_ROOTS[0]), kind)[0])
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises((kubernetes_validate.ValidationError, ValueError, AssertionError)):
        validate(doc)


WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def pod_specs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d["spec"]["template"]["spec"] for d in docs if d["kind"] in WORKLOADS]


def containers(docs: list[dict[str, Any]], name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(spec, c) for spec in pod_specs(docs) for c in spec["containers"] if c["name"] == name]


def test_sidecar_runs_non_root_read_only_without_claiming_a_gpu(
    rendered: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    exporters = containers(docs, SIDECAR)
    assert len(exporters) == 1
    pod, exporter = exporters[0]
    security = {**pod.get("securityContext", {}), **exporter.get("securityContext", {})}
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] != 0
    assert exporter["securityContext"]["readOnlyRootFilesystem"] is True
    assert exporter["securityContext"]["allowPrivilegeEscalation"] is False
    assert exporter["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # NVML on the node's GPUs through the NVIDIA runtime, not through a device-plugin claim.
    env = {e["name"]: e.get("value") for e in exporter.get("env", [])}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "nvidia.com/gpu" not in json.dumps(exporter.get("resources", {}))
    assert any(p["containerPort"] == EXPORTER_PORT for p in exporter["ports"])


def manifest_folder(container: dict[str, Any], volumes: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """(where the container sees the manifest volume, what backs it) for the volume named kv-manifests."""
    mount = next(m for m in container["volumeMounts"] if m["name"] == "kv-manifests")
    source = volumes["kv-manifests"]
    backing = f"hostPath:{source['hostPath']['path']}" if "hostPath" in source else "emptyDir"
    return mount["mountPath"], backing


def test_engine_and_exporter_share_the_manifest_folder(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    (engine_pod, engine), (exporter_pod, exporter) = containers(docs, ENGINE)[0], containers(docs, SIDECAR)[0]
    engine_env = {e["name"]: e.get("value") for e in engine["env"]}
    engine_path, engine_backing = manifest_folder(engine, {v["name"]: v for v in engine_pod["volumes"]})
    exporter_path, exporter_backing = manifest_folder(exporter, {v["name"]: v for v in exporter_pod["volumes"]})
    # The plugin writes where KV_EXPORTER_DIR points; the exporter reads --manifest-dir.
    assert engine_env["KV_EXPORTER_DIR"] == engine_path
    assert f"--manifest-dir={exporter_path}" in exporter["args"]
    assert next(m for m in exporter["volumeMounts"] if m["name"] == "kv-manifests")["readOnly"] is True
    if engine_pod is exporter_pod:
        assert engine_backing == "emptyDir"
        # One PID namespace: the sidecar can verify that manifest writers are alive.
        assert engine_pod["shareProcessNamespace"] is True
    else:
        # Separate pods (node DaemonSet): the same host folder on both sides, host PIDs for NVML matching.
        assert engine_backing == exporter_backing and engine_backing.startswith("hostPath:")
        assert exporter_pod["hostPID"] is True


def test_engine_url_points_at_the_engine(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    (engine_pod, engine), (exporter_pod, exporter) = containers(docs, ENGINE)[0], containers(docs, SIDECAR)[0]
    urls = [a.split("=", 1)[1] for a in exporter["args"] if a.startswith("--engine-url=")]
    assert urls
    engine_port = next(p["containerPort"] for p in engine["ports"] if p["name"] == "http")
    host = "127.0.0.1" if engine_pod is exporter_pod else find(docs, "Service")[0]["metadata"]["name"]
    assert urls == [f"http://{host}:{engine_port}/metrics"]


def selected(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_monitor_scrapes_the_exporter_port(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    monitors = find(docs, "PodMonitor") + find(docs, "ServiceMonitor")
    assert len(monitors) == 1
    monitor = monitors[0]
    # kube-prometheus-stack's default selectors pick monitors and rules by the Helm release label.
    assert "release" in monitor["metadata"]["labels"]
    if monitor["kind"] == "PodMonitor":
        endpoints = monitor["spec"]["podMetricsEndpoints"]
        pods = [
            d["spec"]["template"]
            for d in docs
            if d["kind"] in ("Deployment", "DaemonSet")
            and selected(monitor["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        ports = {
            p["name"]: p["containerPort"] for pod in pods for c in pod["spec"]["containers"] for p in c.get("ports", [])
        }
    else:
        endpoints = monitor["spec"]["endpoints"]
        services = [s for s in find(docs, "Service") if selected(monitor["spec"]["selector"], s["metadata"]["labels"])]
        ports = {p["name"]: p["port"] for s in services for p in s["spec"]["ports"]}
    assert [e["port"] for e in endpoints] == ["kvx-metrics"]
    assert ports.get("kvx-metrics") == EXPORTER_PORT
    # The job label the alerts and the dashboard select.
    relabel = endpoints[0]["relabelings"][0]
    assert (relabel["targetLabel"], relabel["replacement"]) == ("job", "kv-exporter")
    # The exporter's pod labels name the engine's pod: kept over the target's (the sidecar's pod).
    assert endpoints[0]["honorLabels"] is True
    # The node the pod runs on, as kube-prometheus labels node_exporter's series (tests/deploy/test_dashboard_fleet.py
    # runs these relabelings in a real Prometheus).
    node = {"action": "replace", "sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}
    assert node in endpoints[0]["relabelings"]


def container_name_seen(env: dict[str, Any], pod_annotations: dict[str, str]) -> str:
    """What KV_EXPORTER_CONTAINER_NAME resolves to in the pod: its value, or the pod annotation it reads."""
    item = env["KV_EXPORTER_CONTAINER_NAME"]
    if "value" in item:
        return str(item["value"])
    path = item["valueFrom"]["fieldRef"]["fieldPath"]
    assert path.startswith("metadata.annotations['"), path
    return pod_annotations[path.removeprefix("metadata.annotations['").removesuffix("']")]


def test_every_engine_container_names_its_pod_for_the_manifests(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    pods = [d["spec"]["template"] for d in docs if d["kind"] in WORKLOADS]
    engines = [(pod, c) for pod in pods for c in pod["spec"]["containers"] if c["name"] == ENGINE]
    assert engines or find(docs, "DaemonSet"), "no engine container and no node-wide sidecar"
    for pod, engine in engines:
        env = {e["name"]: e for e in engine["env"]}
        assert env["KV_EXPORTER_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["KV_EXPORTER_POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert container_name_seen(env, pod["metadata"].get("annotations", {})) == engine["name"]


def test_prometheusrule_is_the_rules_file(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    (rule,) = find(docs, "PrometheusRule")
    assert rule["spec"]["groups"] == rule_groups()
    assert "release" in rule["metadata"]["labels"]
    assert RULES.exists()


def test_dashboard_configmap_is_the_dashboard(rendered: tuple[Path, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    (config_map,) = find(docs, "ConfigMap", "kv-exporter-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["kv-exporter.json"]) == json.loads(DASHBOARD.read_text())


def test_overlay_shapes() -> None:
    by_name = {root.name: kustomize(root) for root in KUSTOMIZE_ROOTS}
    assert find(by_name["servicemonitor"], "ServiceMonitor") and not find(by_name["servicemonitor"], "PodMonitor")
    omni_engine = containers(by_name["omni-multistage"], ENGINE)[0][1]
    assert omni_engine["command"][:2] == ["vllm-omni", "serve"] and "--omni" in omni_engine["args"]
    assert int(omni_engine["resources"]["limits"]["nvidia.com/gpu"]) >= 2
    node = by_name["node-daemonset"]
    (deployment,) = find(node, "Deployment")
    assert [c["name"] for c in deployment["spec"]["template"]["spec"]["containers"]] == [ENGINE]
    assert find(node, "DaemonSet")
    assert all(p["port"] != EXPORTER_PORT for p in find(node, "Service")[0]["spec"]["ports"])


def test_rendered_yaml_round_trips() -> None:
    """Sanity for the helper: kubectl's YAML parses to the same objects as it prints."""
    docs = kustomize(KUSTOMIZE_ROOTS[0])
    assert yaml.safe_load(yaml.safe_dump(docs[0])) == docs[0]


# --- the sidecar component on a Deployment of the user's own, and the monitoring pieces alone -------------------

KUBERNETES = DASHBOARD.parents[1] / "deploy/kubernetes"
OWN_ENGINE = KUBERNETES / "examples/own-engine"
MONITORING_ROOT = KUBERNETES / "monitoring"
ADDED_ENV = {"KV_EXPORTER_DIR", "KV_EXPORTER_POD_NAME", "KV_EXPORTER_POD_NAMESPACE", "KV_EXPORTER_CONTAINER_NAME"}


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in items}


def test_sidecar_component_adds_the_sidecar_and_nothing_else() -> None:
    """Each of the user's containers keeps every field it had and gains only the manifest volume and the four
    variables (kustomize can address a container only by a name written in the component); the sidecar comes after
    them; the pod learns the engine container's name from the one annotation the user sets, and kubectl still
    defaults to the engine. The Deployment's selector and a Deployment without the annotation are as the user wrote
    them; the rendered resources validate and the sidecar is wired as in the base."""
    (written, router_written) = yaml.safe_load_all((OWN_ENGINE / "engine.yaml").read_text())
    docs = kustomize(OWN_ENGINE)
    for doc in docs:
        validate(doc)
    assert find(docs, "Deployment", "my-router")[0] == router_written
    (rendered,) = find(docs, "Deployment", "my-llm")
    assert rendered["spec"]["selector"] == written["spec"]["selector"]
    named = written["metadata"]["annotations"]["kv-exporter/engine-container"]
    assert rendered["spec"]["template"]["metadata"]["annotations"] == {
        "kv-exporter/engine-container": named,
        "kubectl.kubernetes.io/default-container": named,
    }
    before, after = written["spec"]["template"]["spec"], rendered["spec"]["template"]["spec"]
    assert [c["name"] for c in after["containers"]] == [*(c["name"] for c in before["containers"]), SIDECAR]
    for was, now in zip(before["containers"], after["containers"], strict=False):
        now = copy.deepcopy(now)
        env, mounts = by_name(now.pop("env")), by_name(now.pop("volumeMounts"))
        assert set(env) == set(by_name(was.get("env", []))) | ADDED_ENV
        assert all(env[name] == item for name, item in by_name(was.get("env", [])).items())
        assert set(mounts) == set(by_name(was.get("volumeMounts", []))) | {"kv-manifests"}
        assert now == {k: v for k, v in was.items() if k not in ("env", "volumeMounts")}
    assert by_name(after["volumes"]) == {
        **by_name(before["volumes"]),
        "kv-manifests": {"name": "kv-manifests", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
    }
    # The same wiring checks as every kustomization's.
    rendered_root = (OWN_ENGINE, docs)
    for check in (
        test_sidecar_runs_non_root_read_only_without_claiming_a_gpu,
        test_engine_and_exporter_share_the_manifest_folder,
        test_engine_url_points_at_the_engine,
        test_monitor_scrapes_the_exporter_port,
        test_every_engine_container_names_its_pod_for_the_manifests,
    ):
        check(rendered_root)


def test_monitoring_holds_the_rules_the_monitor_and_the_dashboard_only() -> None:
    docs = kustomize(MONITORING_ROOT)
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "PodMonitor", "PrometheusRule"]
    for doc in docs:
        validate(doc)
    test_prometheusrule_is_the_rules_file((MONITORING_ROOT, docs))
    test_dashboard_configmap_is_the_dashboard((MONITORING_ROOT, docs))
    # The same monitor as the component's: applied in one namespace they are one object.
    (monitor,) = find(docs, "PodMonitor")
    (component_monitor,) = find(kustomize(OWN_ENGINE), "PodMonitor")
    monitor["metadata"]["labels"].pop("app.kubernetes.io/part-of")
    assert monitor == component_monitor
