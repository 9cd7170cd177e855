"""One series and one alert per GPU in the sidecar layout: a node with four GPUs and four engine pods, each pod with
its own sidecar. Every sidecar is the real `serve` (NVML faked at its binding: the node's four GPUs, each listing its
engine's process), its page is read as Prometheus would store it (one `instance` per sidecar), and promtool evaluates
the shipped rules on the four pages together.

- Healthy: each GPU at vLLM's default 0.9 plus a little (73 of 80 GiB used), its engine's declared rows fitting with
  gigabytes to spare: no GPU alert at all. (Before issue 38 every sidecar exported every GPU and the 10 %-of-total
  warning fired 16 times for 4 GPUs, 3 of each 4 copies without the owning engine's growth.)
- Over-committed: each engine's rows at max_num_seqs would pass its GPU's memory: exactly one critical alert per GPU,
  from the sidecar of the pod that uses it, labelled with that pod, and no warning beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from kv_exporter.manifest import DeviceInfo, write_manifest
from kv_exporter.reference import QWEN3_TTS
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.deploy.helpers import alerts, page_series, tool, write_rules_without_annotations
from tests.support.constants import GIB, REPO
from tests.support.manifests import live_manifest
from tests.support.pages import vllm_page_with
from tests.support.sidecar import sidecar, with_prelude

pytestmark = pytest.mark.e2e

GPUS = 4
USED = 73 * GIB
GPU_ALERTS = ("ModelLocalKVProjectedPeakAboveGPUMemory", "ModelLocalKVHeadroomLow", "ModelLocalKVGPUNotProjected")


def uuid(index: int) -> str:
    return f"GPU-{index:08d}-4444-4444-4444-000000000000"


def node_nvml(pid: int) -> str:
    """The sidecar's `pynvml`: the node's four GPUs, each running one engine process (the test's, which every
    manifest names: its pid is what NVML lists on each GPU, whether or not the sidecar's pids are comparable)."""
    devices = ", ".join(
        f"FakeDevice({uuid(i)!r}, 'NVIDIA H100 80GB HBM3', {80 * GIB}, {USED}, [({pid}, {USED - 4 * GIB})])"
        for i in range(GPUS)
    )
    prelude = "import sys\nfrom tests.support.fake_nvml import FakeBinding, FakeDevice\n"
    return prelude + f"sys.modules['pynvml'] = FakeBinding([{devices}])"


def node_pages(workdir: Path, max_num_seqs: int, code: Path = REPO) -> dict[str, str]:
    """Each pod's sidecar page, by the instance Prometheus would give it. `code`: the checkout the sidecars run from."""
    pages = {}
    with contextlib.ExitStack() as stack:
        for i in range(GPUS):
            folder = workdir / f"pod-{i}"
            manifest = live_manifest(QWEN3_TTS, max_num_seqs=max_num_seqs)
            manifest = dataclasses.replace(manifest, device=DeviceInfo(kind="cuda", index=i, uuid=uuid(i)))
            pod = dataclasses.replace(manifest.pod, name=f"tts-{i}", namespace="serving", container="vllm")
            write_manifest(folder, dataclasses.replace(manifest, pod=pod))
            engine = stack.enter_context(SimulatedEngine(vllm_page_with(0, QWEN3_TTS.model_name)))
            args = ("--manifest-dir", str(folder), "--engine-url", engine.url)
            entry = with_prelude(node_nvml(manifest.process.pid))
            running = stack.enter_context(sidecar(workdir, *args, entry=entry, cwd=code))
            pages[f"10.0.{i}.1:9477"] = running.text()
    return pages


def fired(workdir: Path, pages: dict[str, str], rules: Path | None = None) -> dict[str, list[dict[str, str]]]:
    """The GPU alerts the rules (the shipped ones by default) raise on the pages, each alert's labels, by running
    promtool with none expected and reading back what it got."""
    target = {"job": "kv-exporter"}
    series = [s for instance, page in pages.items() for s in page_series(page, {**target, "instance": instance}, 30)]
    rule_file = write_rules_without_annotations(workdir)
    cases = [{"eval_time": "20m", "alertname": name, "exp_alerts": []} for name in GPU_ALERTS]
    test = {"interval": "1m", "input_series": series, "alert_rule_test": cases}
    (workdir / "fanout.test.yml").write_text(yaml.safe_dump({"rule_files": [rule_file], "tests": [test]}))
    done = subprocess.run(
        [tool("promtool"), "test", "rules", "fanout.test.yml"], cwd=workdir, capture_output=True, text=True
    )
    output = done.stdout + done.stderr
    if done.returncode != 0 and "got:" not in output:
        pytest.fail(f"promtool failed without evaluating the alerts:\n{output}")
    return {name: got_alerts(output, name) for name in GPU_ALERTS}


def got_alerts(output: str, name: str) -> list[dict[str, str]]:
    """promtool's report of an alert it did not expect: `alertname: NAME, time: ..., exp:[], got:[...]`."""
    for block in output.split("alertname: ")[1:]:
        if not block.startswith(f"{name},"):
            continue
        got = block.split("got:", 1)[1]
        return [dict(re.findall(r'(\w+)="([^"]*)"', labels)) for labels in re.findall(r"Labels:\{([^}]*)\}", got)]
    return []


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return node_pages(tmp_path_factory.mktemp("healthy"), max_num_seqs=256)


@pytest.fixture(scope="module")
def overcommitted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return node_pages(tmp_path_factory.mktemp("over"), max_num_seqs=2048)


def per_gpu(pages: dict[str, str], family: str) -> dict[str, int]:
    """How many series of `family` the node's sidecars export for each GPU."""
    counts: dict[str, int] = {}
    for page in pages.values():
        for line in page.splitlines():
            if line.startswith(family + "{"):
                gpu = line.split('UUID="', 1)[1].split('"', 1)[0]
                counts[gpu] = counts.get(gpu, 0) + 1
    return counts


def test_each_gpu_is_exported_once_by_its_own_pods_sidecar(healthy: dict[str, str]) -> None:
    for family in ("model_local_kv_gpu_memory_total_bytes", "model_local_kv_gpu_headroom_bytes"):
        assert per_gpu(healthy, family) == {uuid(i): 1 for i in range(GPUS)}, family
    for i, page in enumerate(healthy.values()):
        own = [line for line in page.splitlines() if line.startswith("model_local_kv_gpu_headroom_bytes{")]
        assert len(own) == 1 and uuid(i) in own[0] and f'pod="tts-{i}"' in own[0]


def test_a_healthy_node_at_vllm_defaults_raises_no_gpu_alert(healthy: dict[str, str], tmp_path: Path) -> None:
    assert fired(tmp_path, healthy) == {name: [] for name in GPU_ALERTS}


def test_an_overcommitted_node_raises_one_alert_per_gpu(overcommitted: dict[str, str], tmp_path: Path) -> None:
    got = fired(tmp_path, overcommitted)
    critical = got["ModelLocalKVProjectedPeakAboveGPUMemory"]
    assert sorted((a["UUID"], a["pod"], a["instance"]) for a in critical) == [
        (uuid(i), f"tts-{i}", f"10.0.{i}.1:9477") for i in range(GPUS)
    ]
    assert got["ModelLocalKVHeadroomLow"] == [] and got["ModelLocalKVGPUNotProjected"] == []
    severity = {a["alert"]: a["labels"]["severity"] for a in alerts()}
    assert severity["ModelLocalKVProjectedPeakAboveGPUMemory"] == "critical"


def test_the_count_can_fail(overcommitted: dict[str, str], tmp_path: Path) -> None:
    """The harness sees duplicates: the same pages with each GPU's series copied under a second instance give two
    alerts per GPU."""
    doubled = {**overcommitted, **{f"copy-{k}": v for k, v in overcommitted.items()}}
    critical = fired(tmp_path, doubled)["ModelLocalKVProjectedPeakAboveGPUMemory"]
    assert len(critical) == 2 * GPUS
