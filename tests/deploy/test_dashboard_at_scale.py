"""The dashboard on a fleet of 100 engines in two clusters: 25 real sidecars (`python -m kv_exporter serve`), one per
"GPU node" with a simulated GPU and four engines (the four reference models), each worker keeping its step record
(their pages read too, as a cross-check), scraped by a real Prometheus as the
shipped PodMonitor scrapes them: its relabelings, run as Prometheus runs them, add `job` and the pod's `node`
(`__meta_kubernetes_pod_node_name`, which Kubernetes discovery would set); `cluster` is a target label, as a global
ruler's external label would be.

Every query of every panel returns data with every variable at All; no stat panel shows more than 20 values (today's
main: 25 to 100 here, 112-770 in the issue's fleet); the fleet row's figures equal what the sidecars' own pages say
(read from each sidecar, reduced here in Python); the cluster and node variables offer the fleet's and narrow the
instances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kv_exporter.engine_memory import EngineMemory
from kv_exporter.manifest import Declaration, write_manifest
from kv_exporter.observation import Observation, ObservationState, OwnerObservation
from kv_exporter.reference import REFERENCE_MODELS, ReferenceModel
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from kv_exporter.sidecar.thresholds import HEADROOM_MARGIN_FRACTION
from tests.deploy.grafana import interpolate, panels_without_data, query_variables, selection, variable_values
from tests.deploy.helpers import DEPLOY, Prometheus, dashboard, prometheus_config, start_prometheus
from tests.support.constants import GIB, MIB
from tests.support.manifests import live_manifest
from tests.support.sidecar import Sidecar, sidecar
from tests.support.steps import write_step_record

pytestmark = pytest.mark.e2e

NODES = 25  # x 4 engines (REFERENCE_MODELS) = 100
STAT_LIMIT = 20
UNREADABLE_NODE = 7  # its page and records leave out its last engine: one engine without a running count
PODMONITOR = DEPLOY / "kubernetes/components/sidecar/podmonitor.yaml"


def node_name(node: int) -> str:
    return f"gpu-node-{node:02d}"


def cluster_of(node: int) -> str:
    return "east" if node < 13 else "west"


def max_num_seqs(node: int) -> int:
    return 16 + 16 * (node % 4)


def running(node: int, engine: int) -> int:
    return (node + 3 * engine) % (max_num_seqs(node) + 1)


def used_gib(node: int) -> int:
    return 40 + (node * 37) % 40  # 40-79 GiB of 80: some GPUs at risk, some over


def observation(model: ReferenceModel, node: int, engine: int) -> Observation:
    """A row per running sequence for the first owner, and an undeclared cache of a size of its own; fresh for the
    test's span (stale only after 3 intervals: docs/metrics.md)."""
    owner, spec = model.declarations[0]
    per_row = Declaration.from_spec(owner, spec).bytes_per_row
    rows = running(node, engine)
    held = (
        OwnerObservation(owner, rows * per_row, rows),
        OwnerObservation("vocoder", (node * 4 + engine + 1) * MIB, 1),
    )
    return Observation(ObservationState.OK, "", 600.0, time.time(), 0.001, held, peaks_followed=True)


def engine_page(node: int) -> bytes:
    lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
             "# TYPE vllm:num_requests_running gauge"]  # fmt: skip
    shown = REFERENCE_MODELS[:-1] if node == UNREADABLE_NODE else REFERENCE_MODELS
    for engine, model in enumerate(shown):
        lines.append(f'vllm:num_requests_running{{engine="{node}",model_name="{model.model_name}"}} '
                     f"{float(running(node, engine))}")  # fmt: skip
    return ("\n".join(lines) + "\n").encode()


def start_node(stack: contextlib.ExitStack, workdir: Path, node: int, engines: SimulatedEngine) -> Sidecar:
    folder = workdir / f"manifests-{node:02d}"
    for engine, model in enumerate(REFERENCE_MODELS):
        manifest = live_manifest(model, max_num_seqs=max_num_seqs(node), engine_index=node)
        budget = EngineMemory(kv_cache_bytes=(4 + engine) << 30, kv_cache_blocks=2048, gpu_memory_utilization=0.9)
        observed = dataclasses.replace(manifest, observation=observation(model, node, engine), engine_memory=budget)
        write_manifest(folder, observed)
        if not (node == UNREADABLE_NODE and model is REFERENCE_MODELS[-1]):  # that engine's count: nowhere
            write_step_record(folder, manifest, running(node, engine))
    gpu = f"{80 * GIB}:{used_gib(node) * GIB}"
    args = ("--manifest-dir", str(folder), "--engine-url", engines.url_for(f"/n{node}/metrics"), "--simulate-gpu", gpu)
    return stack.enter_context(sidecar(workdir, *args))


def relabel_configs() -> list[dict[str, Any]]:
    """The shipped PodMonitor's relabelings as Prometheus' relabel_configs (what prometheus-operator writes)."""
    (endpoint,) = yaml.safe_load(PODMONITOR.read_text())["spec"]["podMetricsEndpoints"]
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return [{keys.get(k, k): v for k, v in relabeling.items()} for relabeling in endpoint["relabelings"]]


@dataclass
class Fleet:
    prometheus: Prometheus
    sidecars: dict[int, Sidecar]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("scale")
    with contextlib.ExitStack() as stack:
        engines = stack.enter_context(SimulatedEngine({f"/n{n}/metrics": engine_page(n) for n in range(NODES)}))
        sidecars = {node: start_node(stack, workdir, node, engines) for node in range(NODES)}
        config = prometheus_config([], interval="2s")
        (job,) = config["scrape_configs"]
        job["honor_labels"] = True  # as the shipped monitor
        job["relabel_configs"] = relabel_configs()
        job["static_configs"] = [
            {
                "targets": [sc.address],
                "labels": {"cluster": cluster_of(node), "__meta_kubernetes_pod_node_name": node_name(node)},
            }
            for node, sc in sidecars.items()
        ]
        prometheus = stack.enter_context(start_prometheus(workdir / "prometheus", config, {}))
        prometheus.wait_for(f'count(up{{job="kv-exporter"}} == 1) == {NODES}', 60)
        # Rate windows ($__rate_interval = 1m here) need two samples inside them.
        prometheus.wait_for(f"count(count_over_time(model_local_kv_nvml_up[1m]) >= 3) == {NODES}", 60)
        yield Fleet(prometheus, sidecars)


def test_every_panel_returns_data_at_100_engines(fleet: Fleet) -> None:
    engines = fleet.prometheus.query("count(model_local_kv_engine_manifests)")
    assert float(engines[0]["value"][1]) == NODES * len(REFERENCE_MODELS) == 100
    assert not panels_without_data(fleet.prometheus, 30)


def test_no_stat_panel_shows_more_than_20_values(fleet: Fleet) -> None:
    chosen = selection(fleet.prometheus)
    crowded = []
    for panel in dashboard()["panels"]:
        if panel["type"] != "stat":
            continue
        shown = sum(len(fleet.prometheus.query(interpolate(t["expr"], chosen))) for t in panel["targets"])
        if shown > STAT_LIMIT:
            crowded.append(f"{panel['title']!r}: {shown} values")
    assert not crowded


# --- the fleet row against the sidecars' own pages ----------------------------------------------------------------


@dataclass(frozen=True)
class NodeFigures:
    """What one sidecar's page says."""

    headroom_share: float
    safe_max_num_seqs: float
    engines_unreadable: int
    unexplained: list[float]
    models: set[str]


def figures(sc: Sidecar) -> NodeFigures:
    samples = sc.samples()

    def values(metric: str) -> list[tuple[dict[str, str], float]]:
        return [(dict(labels), value) for (name, labels), value in samples.items() if name == metric]

    ((_, headroom),) = values("model_local_kv_gpu_headroom_bytes")
    ((_, declared),) = values("model_local_kv_gpu_declared_ceiling_bytes")
    ((_, safe),) = values("model_local_kv_gpu_safe_max_num_seqs")
    return NodeFigures(
        headroom / declared,  # ModelLocalKVHeadroomLow's measure: a share of the KV declared on the GPU
        safe,
        sum(1 for _, up in values("model_local_kv_engine_up") if up == 0),
        [value for _, value in values("model_local_kv_unexplained_bytes")],
        {labels["model_name"] for labels, _ in values("model_local_kv_declaration_info")},
    )


def fleet_row(fleet: Fleet) -> dict[str, list[dict[str, Any]]]:
    """Each fleet-row panel's result, every variable at All."""
    chosen, out, row = selection(fleet.prometheus), {}, ""
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        elif row == "Fleet":
            (target,) = panel["targets"]
            out[panel["title"]] = fleet.prometheus.query(interpolate(target["expr"], chosen))
    return out


def one(result: list[dict[str, Any]]) -> float:
    (sample,) = result
    return float(sample["value"][1])


def ranked(result: list[dict[str, Any]]) -> list[float]:
    return sorted(float(sample["value"][1]) for sample in result)


def test_the_fleet_row_equals_the_sidecars_own_figures(fleet: Fleet) -> None:
    by_node = {node: figures(sc) for node, sc in fleet.sidecars.items()}
    shares = sorted(f.headroom_share for f in by_node.values())
    assert shares[0] < 0 < HEADROOM_MARGIN_FRACTION < shares[-1], "the fleet must have GPUs in every state"
    shown = fleet_row(fleet)
    assert one(shown["GPUs at risk"]) == sum(1 for s in shares if s < HEADROOM_MARGIN_FRACTION)
    assert one(shown["GPUs that cannot hold their declared peak"]) == sum(1 for s in shares if s < 0)
    assert one(shown["Engines without a running count"]) == sum(f.engines_unreadable for f in by_node.values()) == 1
    assert one(shown["Exporters down"]) == 0
    top = len(shown["Worst headroom per GPU"])
    assert top == 10
    assert ranked(shown["Worst headroom per GPU"]) == pytest.approx(shares[:top])
    worst_by_model = {
        model.model_name: min(f.headroom_share for f in by_node.values() if model.model_name in f.models)
        for model in REFERENCE_MODELS
    }
    result = shown["Worst headroom per model"]
    assert {s["metric"]["model_name"]: float(s["value"][1]) for s in result} == pytest.approx(worst_by_model)
    safe = sorted(f.safe_max_num_seqs for f in by_node.values())
    assert ranked(shown["Lowest safe max_num_seqs"]) == pytest.approx(safe[:top])
    unexplained = sorted(value for f in by_node.values() for value in f.unexplained)
    assert ranked(shown["Most unexplained bytes"]) == pytest.approx(unexplained[-top:])


def test_cluster_and_node_variables_offer_the_fleet_and_narrow_the_instances(fleet: Fleet) -> None:
    variables = {v["name"]: v for v in query_variables()}
    everything = selection(fleet.prometheus)
    assert variable_values(fleet.prometheus, variables["cluster"], everything) == ["east", "west"]
    assert variable_values(fleet.prometheus, variables["node"], everything) == sorted(map(node_name, range(NODES)))
    east = selection(fleet.prometheus, {"cluster": "east"})
    instances = variable_values(fleet.prometheus, variables["instance"], east)
    assert instances == sorted(sc.address for node, sc in fleet.sidecars.items() if cluster_of(node) == "east")
    one_node = selection(fleet.prometheus, {"node": node_name(3)})
    assert variable_values(fleet.prometheus, variables["instance"], one_node) == [fleet.sidecars[3].address]
