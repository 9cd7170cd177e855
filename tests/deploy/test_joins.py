"""The joins docs/metrics.md documents, run as written there in a real Prometheus.

Prometheus scrapes a real sidecar (`python -m kv_exporter serve`) as the shipped monitors do (`honor_labels`,
the target's own `namespace`, `pod` and `node` as target labels), and two dcgm-exporter pages and a kube-state-metrics
page served on 127.0.0.1, with the labels and units those exporters use (kube-state-metrics: `kube_pod_info` by
namespace and pod). The sidecar has one worker with pod information (`tts-0`) and one without, which must keep the
target's namespace and pod.

dcgm-exporter's pages come in the three shapes its own sources give (NVIDIA/dcgm-exporter: etc/default-counters.csv,
internal/pkg/rendermetrics/render_metrics.go, the 4.8.3 and 4.9.0 release notes), and every recipe runs on each:
- up to 4.8.2: `DCGM_FI_DEV_FB_USED`, `_FREE`, `_RESERVED` in MiB (the last by default since 4.5.0), label `Hostname`;
- 4.8.3: the same, label `hostname`;
- 4.9.0: memory in bytes, `DCGM_FI_DEV_FB_CAPACITY_BYTES` (total) collected by default; the used and free fields
  renamed to DCGM 4.7's names (the recipes do not read them).
Today's main's recipe read `DCGM_FI_DEV_FB_USED * 2^20` and returned nothing on a 4.9.0 page.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
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
# `node` as the shipped monitors relabel it from __meta_kubernetes_pod_node_name.
TARGET_POD = {"namespace": "serving", "pod": "mimo-0", "container": "kv-exporter", "node": "node-a"}
OTHER_HOST_UUID = "GPU-ffffffff-0000-0000-0000-00000000000b"
# Each GPU's memory as dcgm-exporter reports it (MiB): used, free, reserved. Total = their sum (80 GiB, 24 GiB).
DCGM_MIB = {
    gpu_uuid(0): (61_440, 20_000, 480),
    gpu_uuid(1): (20_480, 3_584, 512),
    OTHER_HOST_UUID: (1_024, 80_896, 0),
}
SHAPES = ("4.8.2", "4.8.3", "4.9.0")


def total_bytes(uuid: str) -> int:
    return sum(DCGM_MIB[uuid]) * MIB


def dcgm_series(shape: str) -> list[tuple[str, str, Callable[[str], int]]]:
    """(family, HELP, value per UUID) of a page of `shape`, as its default counters configure them."""
    if shape == "4.9.0":
        return [("DCGM_FI_DEV_FB_CAPACITY_BYTES", "Total GPU memory (in bytes).", total_bytes)]
    mib = [("USED", 0, "used"), ("FREE", 1, "free"), ("RESERVED", 2, "reserved")]
    return [
        (f"DCGM_FI_DEV_FB_{name}", f"Framebuffer memory {what} (in MiB).", lambda uuid, i=i: DCGM_MIB[uuid][i])
        for name, i, what in mib
    ]


def dcgm_page(shape: str, host: str, gpus: list[tuple[int, str, str | None]]) -> bytes:
    """A dcgm-exporter page of `shape`: (gpu index, UUID, pod using it or None) per GPU of `host`."""
    host_label = "Hostname" if shape == "4.8.2" else "hostname"
    lines = []
    for family, help_text, value in dcgm_series(shape):
        lines += [f"# HELP {family} {help_text}", f"# TYPE {family} gauge"]
        for index, uuid, pod in gpus:
            where = f',container="engine",namespace="serving",pod="{pod}"' if pod else ""
            labels = f'gpu="{index}",UUID="{uuid}",device="nvidia{index}",modelName="NVIDIA H100",{host_label}="{host}"'
            lines.append(f"{family}{{{labels}{where}}} {value(uuid)}")
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
    shape: str


def manifest_in(model: ReferenceModel, gpu: int, pod: PodInfo) -> Manifest:
    manifest = live_manifest(model, max_num_seqs=64)
    return dataclasses.replace(manifest, device=DeviceInfo(kind="cuda", index=gpu, uuid=gpu_uuid(gpu)), pod=pod)


@pytest.fixture(scope="module", params=SHAPES, ids=lambda shape: f"dcgm-exporter-{shape}")
def joins(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Joins]:
    shape: str = request.param
    workdir = tmp_path_factory.mktemp("joins")
    folder = workdir / "manifests"
    write_manifest(folder, manifest_in(QWEN3_TTS, 0, PodInfo("tts-0", "serving", "engine")))
    write_manifest(folder, manifest_in(MIMO_AUDIO, 1, PodInfo()))
    with contextlib.ExitStack() as stack:
        exporter = stack.enter_context(sidecar(workdir, "--manifest-dir", str(folder), *SIMULATE_GPU))
        host_a = dcgm_page(shape, "node-a", [(0, gpu_uuid(0), "tts-0"), (1, gpu_uuid(1), "mimo-0")])
        host_b = dcgm_page(shape, "node-b", [(0, OTHER_HOST_UUID, None)])
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
        yield Joins(prometheus, exporter, shape)


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


def test_dcgm_join_by_uuid(joins: Joins) -> None:
    by_uuid, *_ = recipes()
    result = values(joins.prometheus.query(by_uuid), "UUID")
    ceilings = exported_sum(joins.exporter, "model_local_kv_ceiling_bytes", "UUID")
    assert set(result) == {(gpu_uuid(0),), (gpu_uuid(1),)}
    for (uuid,), share in result.items():
        assert share == pytest.approx(ceilings[uuid] / total_bytes(uuid))
        assert 0 < share < 1, "MiB read as bytes would make the share 2^20 times too large"


def test_dcgm_join_by_its_exported_pod(joins: Joins) -> None:
    _, by_pod, *_ = recipes()
    result = values(joins.prometheus.query(by_pod), "namespace", "pod")
    estimates = exported_sum(joins.exporter, "model_local_kv_estimated_bytes", "model_name")
    assert result == pytest.approx(
        {
            ("serving", "tts-0"): estimates[QWEN3_TTS.model_name] / total_bytes(gpu_uuid(0)),
            ("serving", "mimo-0"): estimates[MIMO_AUDIO.model_name] / total_bytes(gpu_uuid(1)),
        }
    )


def test_dcgm_join_by_node_and_gpu_whichever_the_host_labels_spelling(joins: Joins) -> None:
    """`gpu` with the host: kv-exporter's `node` (the monitors' relabeling) against dcgm-exporter's `Hostname`
    (before 4.8.3) or `hostname`; node-b's GPU 0 is not node-a's."""
    *_, by_node, _ = recipes()
    result = values(joins.prometheus.query(by_node), "node", "gpu")
    ceilings = exported_sum(joins.exporter, "model_local_kv_ceiling_bytes", "gpu")
    assert result == pytest.approx({("node-a", str(i)): ceilings[str(i)] / total_bytes(gpu_uuid(i)) for i in (0, 1)})


def test_kube_pod_info_join_by_namespace_and_pod(joins: Joins) -> None:
    *_, by_pod_info = recipes()
    result = values(joins.prometheus.query(by_pod_info), "namespace", "pod", "node", "created_by_name")
    ceilings = exported_sum(joins.exporter, "model_local_kv_ceiling_bytes", "model_name")
    assert result == {
        ("serving", "tts-0", "node-a", "tts"): ceilings[QWEN3_TTS.model_name],
        ("serving", "mimo-0", "node-a", "mimo-5d9f"): ceilings[MIMO_AUDIO.model_name],
    }


def test_a_join_by_gpu_alone_is_many_to_many(joins: Joins) -> None:
    """Both hosts have a GPU 0: matching on `gpu` alone pairs them, and Prometheus refuses the query."""
    expr = "sum by (gpu) (model_local_kv_ceiling_bytes) / on (gpu) group_left () DCGM_FI_DEV_FB_CAPACITY_BYTES"
    if joins.shape != "4.9.0":
        expr = "sum by (gpu) (model_local_kv_ceiling_bytes) / on (gpu) group_left () (DCGM_FI_DEV_FB_USED * 2^20)"
    url = f"{joins.prometheus.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=10)
    error = json.loads(refused.value.read())["error"]
    assert "many-to-many" in error or "duplicate series" in error, error
    assert "many-to-many" in METRICS_DOC.read_text().split("\n## Joins\n", 1)[1].split("\n## ", 1)[0]


def test_the_docs_hold_the_recipes_this_test_runs() -> None:
    blocks = recipes()
    assert len(blocks) == 4
    for block in blocks[:3]:  # both page shapes: bytes from 4.9.0, MiB before
        assert "DCGM_FI_DEV_FB_CAPACITY_BYTES" in block and "2^20" in block
    assert "on (UUID)" in blocks[0]
    assert "exported_pod" in blocks[1]
    assert '"Hostname"' in blocks[2] and "on (node, gpu)" in blocks[2]
    assert "kube_pod_info" in blocks[3] and "on (namespace, pod)" in blocks[3]
