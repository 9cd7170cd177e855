"""The dashboard in the DaemonSet layout: one sidecar, two pods of one model (on GPUs 0 and 1) and a pod of another
model (on GPU 1), in a real Prometheus. The namespace and pod variables offer them, chained; no panel merges the two
pods of one model; and with one GPU selected, the engine panels leave out the engine whose declarations are all on
the other GPU."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kv_exporter.manifest import DeviceInfo, Manifest, PodInfo, write_manifest
from kv_exporter.reference import MIMO_AUDIO, QWEN3_TTS, ReferenceModel
from tests.deploy.grafana import interpolate, query_variables, selection, variable_values
from tests.deploy.helpers import Prometheus, dashboard, prometheus_config, start_prometheus
from tests.support.constants import SIMULATE_GPU, gpu_uuid
from tests.support.manifests import live_manifest
from tests.support.sidecar import sidecar

pytestmark = pytest.mark.e2e

# (model, pod, namespace, GPU, tensor-parallel rank: the second pod's file needs a name of its own here)
WORKERS = [
    (QWEN3_TTS, "tts-0", "serving", 0, 0),
    (QWEN3_TTS, "tts-1", "serving", 1, 1),
    (MIMO_AUDIO, "mimo-0", "other", 1, 0),
]


@dataclass
class Node:
    prometheus: Prometheus


def worker(model: ReferenceModel, pod: str, namespace: str, gpu: int, tp_rank: int) -> Manifest:
    manifest = live_manifest(model, max_num_seqs=64)
    return dataclasses.replace(
        manifest,
        engine=dataclasses.replace(manifest.engine, tp_rank=tp_rank),
        device=DeviceInfo(kind="cuda", index=gpu, uuid=gpu_uuid(gpu)),
        pod=PodInfo(pod, namespace, "engine"),
    )


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    workdir = tmp_path_factory.mktemp("pods")
    for spec in WORKERS:
        write_manifest(workdir / "manifests", worker(*spec))
    with contextlib.ExitStack() as stack:
        exporter = stack.enter_context(sidecar(workdir, "--manifest-dir", str(workdir / "manifests"), *SIMULATE_GPU))
        config = prometheus_config([exporter.address])
        config["scrape_configs"][0]["honor_labels"] = True  # as the shipped monitors
        prometheus = stack.enter_context(start_prometheus(workdir / "prometheus", config, {}))
        prometheus.wait_for("model_local_kv_declaration_info", 30)
        prometheus.wait_for("count_over_time(model_local_kv_nvml_up[1m]) >= 3", 30)
        yield Node(prometheus)


def panel_series(prometheus: Prometheus, picks: dict[str, str]) -> list[tuple[str, str, dict[str, str]]]:
    """(row, panel title, labels) of every series every query returns with `picks` selected, All elsewhere."""
    chosen = selection(prometheus, picks)
    out, row = [], ""
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        for target in panel.get("targets", []):
            for sample in prometheus.query(interpolate(target["expr"], chosen)):
                out.append((row, panel["title"], sample["metric"]))
    return out


def test_namespace_and_pod_variables_chain(node: Node) -> None:
    variables = {v["name"]: v for v in query_variables()}
    everything = selection(node.prometheus)
    assert variable_values(node.prometheus, variables["namespace"], everything) == ["other", "serving"]
    assert variable_values(node.prometheus, variables["pod"], everything) == ["mimo-0", "tts-0", "tts-1"]
    serving = selection(node.prometheus, {"namespace": "serving"})
    assert variable_values(node.prometheus, variables["pod"], serving) == ["tts-0", "tts-1"]
    # Engine series carry their first rank's pod (docs/metrics.md, "Per engine"): the models chain on it.
    one_pod = selection(node.prometheus, {"pod": "mimo-0"})
    assert variable_values(node.prometheus, variables["model_name"], one_pod) == [MIMO_AUDIO.model_name]


def test_no_panel_merges_two_pods_of_one_model(node: Node) -> None:
    series = panel_series(node.prometheus, {})
    # The fleet row ranks models by their worst GPU on purpose; every other panel keeps the pods apart.
    merged = sorted(
        {title for row, title, labels in series if row != "Fleet" and "model_name" in labels and "pod" not in labels}
    )
    assert not merged, f"panels that sum the pods away: {merged}"
    per_owner = {labels["pod"] for _, title, labels in series if "owner" in labels}
    assert per_owner == {pod for _, pod, *_ in WORKERS}


def test_one_pod_selected_shows_only_that_pod(node: Node) -> None:
    pods = {labels["pod"] for *_, labels in panel_series(node.prometheus, {"pod": "tts-1"}) if "pod" in labels}
    assert pods == {"tts-1"}


def test_engine_panels_follow_the_gpu_selection(node: Node) -> None:
    """MiMo-Audio's only worker is on GPU 1: with GPU 0 selected no panel shows it; with All the engine row does."""

    def engine_models(picks: dict[str, str]) -> set[str]:
        return {m["model_name"] for row, _, m in panel_series(node.prometheus, picks) if row == "Engines"}

    assert engine_models({}) == {QWEN3_TTS.model_name, MIMO_AUDIO.model_name}
    assert engine_models({"gpu": "0"}) == {QWEN3_TTS.model_name}
    shown = {m.get("model_name") for *_, m in panel_series(node.prometheus, {"gpu": "0"})}
    assert MIMO_AUDIO.model_name not in shown
