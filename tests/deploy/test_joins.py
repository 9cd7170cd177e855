"""The joins docs/metrics.md documents, run as written there in a real Prometheus.

Prometheus scrapes a real sidecar (`python -m kv_exporter serve`) as the shipped monitors do (`honor_labels`,
the target's own `namespace` and `pod` as target labels), and two dcgm-exporter pages and a kube-state-metrics page
served on 127.0.0.1, with the labels and units those exporters use (dcgm-exporter: MiB, `gpu`, `UUID`, its
attribution of each GPU to a pod; kube-state-metrics: `kube_pod_info` by namespace and pod). The sidecar has one
worker with pod information (`tts-0`) and one without, which must keep the target's namespace and pod.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kv_exporter.manifest import DeviceInfo, Manifest, PodInfo, write_manifest
from kv_exporter.reference import MIMO_AUDIO, QWEN3_TTS, ReferenceModel
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.deploy.helpers import Prometheus, start_prometheus
from tests.support.constants import REPO, SIMULATE_GPU, gpu_uuid
from tests.support.manifests import live_manifest
from tests.support.sidecar import Sidecar, sidecar

pytestmark = pytest.mark.e2e

METRICS_DOC = REPO / "docs/metrics.md"
MIB = 2**20
# The kv-exporter target's own pod (the engine pod its sidecar runs in): a worker without pod information is that.
TARGET_POD = {"namespace": "serving", "pod": "mimo-0", "container": "kv-exporter"}
# What dcgm-exporter reports used on each GPU (MiB), and whose pod it says uses it.
DCGM_USED_MIB = {gpu_uuid(0): 61_440, gpu_uuid(1): 20_480, "GPU-ffffffff-0000-0000-0000-00000000000b": 1_024}
OTHER_HOST_UUID = "GPU-ffffffff-0000-0000-0000-00000000000b"


def dcgm_page(host: str, gpus: list[tuple[int, str, str | None]]) -> bytes:
    """A dcgm-exporter page: (gpu index, UUID, pod using it or None) per GPU of `host`."""
    lines = ["# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).", "# TYPE DCGM_FI_DEV_FB_USED gauge"]
    for index, uuid, pod in gpus:
        where = f',container="engine",namespace="serving",pod="{pod}"' if pod else ""
        labels = f'gpu="{index}",UUID="{uuid}",device="nvidia{index}",modelName="NVIDIA H100",Hostname="{host}"'
        lines.append(f"DCGM_FI_DEV_FB_USED{{{labels}{where}}} {DCGM_USED_MIB[uuid]}")
    return ("\n".join(lines) + "\n").encode()


# kube_pod_info per pod: (namespace, pod, node, created_by_kind, created_by_name).
PODS = [
    ("serving", "tts-0", "node-a", "StatefulSet", "tts"),
    ("serving", "mimo-0", "node-a", "ReplicaSet", "mimo-5d9f"),
    ("other", "web-0", "node-b", "ReplicaSet", "web-1"),
]
KSM_PAGE = "# HELP kube_pod_info Information about pod.\n# TYPE kube_pod_info gauge\n" + "".join(
    f'kube_pod_info{{namespace="{ns}",pod="{pod}",node="{node}",created_by_kind="{kind}",created_by_name="{by}"}} 1\n'
    for ns, pod, node, kind, by in PODS
)


def recipes() -> list[str]:
    """The PromQL blocks of docs/metrics.md's *Joins* section, in order."""
    text = METRICS_DOC.read_text()
    section = text.split("\n## Joins\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```promql\n(.*?)```", section, flags=re.S)


@dataclass
class Joins:
    prometheus: Prometheus
    exporter: Sidecar


def manifest_in(model: ReferenceModel, gpu: int, pod: PodInfo) -> Manifest:
    manifest = live_manifest(model, max_num_seqs=64)
    return dataclasses.replace(manifest, device=DeviceInfo(kind="cuda", index=gpu, uuid=gpu_uuid(gpu)), pod=pod)


@pytest.fixture(scope="module")
def joins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Joins]:
    workdir = tmp_path_factory.mktemp("joins")
    folder = workdir / "manifests"
    write_manifest(folder, manifest_in(QWEN3_TTS, 0, PodInfo("tts-0", "serving", "engine")))
    write_manifest(folder, manifest_in(MIMO_AUDIO, 1, PodInfo()))
    with contextlib.ExitStack() as stack:
        exporter = stack.enter_context(sidecar(workdir, "--manifest-dir", str(folder), *SIMULATE_GPU))
        host_a = dcgm_page("node-a", [(0, gpu_uuid(0), "tts-0"), (1, gpu_uuid(1), "mimo-0")])
        host_b = dcgm_page("node-b", [(0, OTHER_HOST_UUID, None)])
        dcgm = [stack.enter_context(SimulatedEngine(page)) for page in (host_a, host_b)]
        ksm = stack.enter_context(SimulatedEngine(KSM_PAGE.encode()))

        def target(engine_url: str) -> str:
            return urllib.parse.urlsplit(engine_url).netloc

        dcgm_targets = [
            {"targets": [target(d.url)], "labels": {"namespace": "gpu-operator", "pod": f"dcgm-{i}", "container": "x"}}
            for i, d in enumerate(dcgm)
        ]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                # As the shipped PodMonitor: honor the exported pod; the target's pod as target labels.
                {
                    "job_name": "kv-exporter",
                    "honor_labels": True,
                    "static_configs": [{"targets": [exporter.address], "labels": TARGET_POD}],
                },
                {"job_name": "dcgm-exporter", "static_configs": dcgm_targets},
                {
                    "job_name": "kube-state-metrics",
                    "honor_labels": True,
                    "static_configs": [{"targets": [target(ksm.url)]}],
                },
            ],
        }
        prometheus = stack.enter_context(start_prometheus(workdir / "prometheus", config, {}))
        prometheus.wait_for("count(up == 1) == 4", 30, "every target up")
        prometheus.wait_for("model_local_kv_ceiling_bytes", 30)
        yield Joins(prometheus, exporter)


def values(result: list[dict[str, object]], *labels: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(sample["metric"][name] for name in labels): float(sample["value"][1])  # type: ignore[index]
        for sample in result
    }


def exported_sum(exporter: Sidecar, metric: str, label: str) -> dict[str, float]:
    """The sidecar's own page, summed by one label (what the joins must reproduce from Prometheus)."""
    sums: dict[str, float] = {}
    for (name, labels), value in exporter.samples().items():
        if name == metric:
            key = dict(labels).get(label, "")
            sums[key] = sums.get(key, 0.0) + value
    return sums


def test_prometheus_reads_every_spliced_gzip_page(joins: Joins) -> None:
    """From its second page on, the sidecar's gzip body is spliced from pieces compressed alone
    (sidecar/gzipped.py): Go's gzip reader in a real Prometheus takes every one, each with every declaration."""
    declared = sum(1 for name, _ in joins.exporter.samples() if name == "model_local_kv_bytes_per_row")
    assert declared
    joins.prometheus.wait_for('count_over_time(up{job="kv-exporter"}[1m]) >= 5', 30, "five scrapes")
    assert values(joins.prometheus.query('min_over_time(up{job="kv-exporter"}[1m])'))[()] == 1
    seen = joins.prometheus.query('count_over_time(model_local_kv_bytes_per_row{job="kv-exporter"}[1m]) >= 5')
    assert len(seen) == declared


def test_a_worker_without_pod_information_keeps_the_targets_pod(joins: Joins) -> None:
    """No empty label reaches Prometheus: the pod-less worker's series keep the target's namespace and pod (an
    exported pod="" would delete them under honor_labels), the other worker's keep its own."""
    assert '=""' not in joins.exporter.text()
    pods = values(joins.prometheus.query("model_local_kv_ceiling_bytes"), "model_name", "namespace", "pod")
    assert {key[:3] for key in pods} == {
        (QWEN3_TTS.model_name, "serving", "tts-0"),
        (MIMO_AUDIO.model_name, TARGET_POD["namespace"], TARGET_POD["pod"]),
    }


def test_dcgm_join_by_uuid_in_mib(joins: Joins) -> None:
    by_uuid, _, _ = recipes()
    result = values(joins.prometheus.query(by_uuid), "UUID")
    ceilings = exported_sum(joins.exporter, "model_local_kv_ceiling_bytes", "UUID")
    assert set(result) == {(gpu_uuid(0),), (gpu_uuid(1),)}
    for (uuid,), share in result.items():
        assert share == pytest.approx(ceilings[uuid] / (DCGM_USED_MIB[uuid] * MIB))
        assert 0 < share < 1, "MiB read as bytes would make the share 2^20 times too large"


def test_dcgm_join_by_its_exported_pod(joins: Joins) -> None:
    _, by_pod, _ = recipes()
    result = values(joins.prometheus.query(by_pod), "namespace", "pod")
    estimates = exported_sum(joins.exporter, "model_local_kv_estimated_bytes", "model_name")
    assert result == pytest.approx(
        {
            ("serving", "tts-0"): estimates[QWEN3_TTS.model_name] / (DCGM_USED_MIB[gpu_uuid(0)] * MIB),
            ("serving", "mimo-0"): estimates[MIMO_AUDIO.model_name] / (DCGM_USED_MIB[gpu_uuid(1)] * MIB),
        }
    )


def test_kube_pod_info_join_by_namespace_and_pod(joins: Joins) -> None:
    _, _, by_pod_info = recipes()
    result = values(joins.prometheus.query(by_pod_info), "namespace", "pod", "node", "created_by_name")
    ceilings = exported_sum(joins.exporter, "model_local_kv_ceiling_bytes", "model_name")
    assert result == {
        ("serving", "tts-0", "node-a", "tts"): ceilings[QWEN3_TTS.model_name],
        ("serving", "mimo-0", "node-a", "mimo-5d9f"): ceilings[MIMO_AUDIO.model_name],
    }


def test_a_join_by_gpu_alone_is_many_to_many(joins: Joins) -> None:
    """Both hosts have a GPU 0: matching on `gpu` alone pairs them, and Prometheus refuses the query."""
    expr = "sum by (gpu) (model_local_kv_ceiling_bytes) / on (gpu) group_left () (DCGM_FI_DEV_FB_USED * 2^20)"
    url = f"{joins.prometheus.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=10)
    error = json.loads(refused.value.read())["error"]
    assert "many-to-many" in error or "duplicate series" in error, error
    assert "many-to-many" in METRICS_DOC.read_text().split("\n## Joins\n", 1)[1].split("\n## ", 1)[0]


def test_the_docs_hold_the_recipes_this_test_runs() -> None:
    blocks = recipes()
    assert len(blocks) == 3
    assert "on (UUID)" in blocks[0] and "2^20" in blocks[0]
    assert "exported_pod" in blocks[1]
    assert "kube_pod_info" in blocks[2] and "on (namespace, pod)" in blocks[2]
