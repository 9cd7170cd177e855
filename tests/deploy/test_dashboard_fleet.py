"""The dashboard on a fleet: a real Prometheus scraping two real sidecars (`python -m kv_exporter serve`) on two
"hosts" with different models, engines and simulated GPUs, both GPU 0. Every query of every panel is run as Grafana
sends it, with every variable at All and with one instance selected: each returns data, and with one instance only
that instance's series, with that sidecar's own figures. Prometheus also loads an operator's threshold file beside
the shipped rules: no duplicate samples, and the override is in force."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kv_exporter.engine_memory import EngineMemory
from kv_exporter.manifest import Declaration, write_manifest
from kv_exporter.observation import CudaMemory, Observation, ObservationState, OwnerObservation
from kv_exporter.reference import MIMO_AUDIO, QWEN3_TTS, ReferenceModel
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.deploy.grafana import (
    FILTER_VARIABLES,
    SELECTOR,
    interpolate,
    query_variables,
    selection,
    variable_values,
)
from tests.deploy.helpers import (
    RULES,
    THRESHOLDS_EXAMPLE,
    Prometheus,
    dashboard_targets,
    prometheus_config,
    start_prometheus,
)
from tests.support.manifests import live_manifest
from tests.support.pages import vllm_page_with
from tests.support.sidecar import Sidecar, sidecar
from tests.support.steps import write_step_record

pytestmark = pytest.mark.e2e

# host name -> (model, running, max_num_seqs, simulated GPU)
HOSTS: dict[str, tuple[ReferenceModel, int, int, str]] = {
    "a": (QWEN3_TTS, 17, 256, "80GiB:60GiB"),
    "b": (MIMO_AUDIO, 3, 64, "24GiB:20GiB"),
}


@dataclass
class Fleet:
    prometheus: Prometheus
    instances: dict[str, str]  # host -> instance label
    sidecars: dict[str, Sidecar]


def observation(model: ReferenceModel, running: int) -> Observation:
    """What the host's caches hold: a row per running sequence for its first owner, and a cache nobody declared.
    Fresh for the test's span (stale only after 3 intervals: docs/metrics.md)."""
    owner, spec = model.declarations[0]
    per_row = Declaration.from_spec(owner, spec).bytes_per_row
    held = (OwnerObservation(owner, running * per_row, running), OwnerObservation("vocoder", 1 << 20, 1))
    # vLLM 0.34's capped allocator: 4 GiB reserved, the cap 2 GiB above.
    cuda = CudaMemory(4 << 30, 4 << 30, 4 << 30, 4 << 30, 4 << 30, limit_bytes=6 << 30)
    return Observation(ObservationState.OK, "", 10.0, time.time(), 0.001, held, cuda, peaks_followed=True)


def start_host(stack: contextlib.ExitStack, workdir: Path, host: str) -> Sidecar:
    model, running, max_num_seqs, gpu = HOSTS[host]
    folder = workdir / f"manifests-{host}"
    manifest = live_manifest(model, max_num_seqs=max_num_seqs)
    budget = EngineMemory(kv_cache_bytes=8 << 30, kv_cache_blocks=4096, gpu_memory_utilization=1.0)
    write_manifest(folder, dataclasses.replace(manifest, observation=observation(model, running), engine_memory=budget))
    write_step_record(folder, manifest, running)
    # A broken file beside it: the manifest-error panel gets data on each host.
    (folder / "broken-by-test.json").write_text('{"schema_version": 1, "truncated": ')
    engine = stack.enter_context(SimulatedEngine(vllm_page_with(running, model.model_name)))
    args = ("--manifest-dir", str(folder), "--engine-url", engine.url, "--simulate-gpu", gpu)
    return stack.enter_context(sidecar(workdir, *args))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("fleet")
    with contextlib.ExitStack() as stack:
        sidecars = {host: start_host(stack, workdir, host) for host in HOSTS}
        instances = {host: sc.url.removeprefix("http://") for host, sc in sidecars.items()}
        config = prometheus_config(list(instances.values()))
        rules = {RULES.name: RULES.read_text(), "my-thresholds.rules.yml": THRESHOLDS_EXAMPLE.read_text()}
        prometheus = stack.enter_context(start_prometheus(workdir / "prometheus", config, rules))
        prometheus.wait_for('count(up{job="kv-exporter"} == 1) == 2', 30)
        # Rate windows ($__rate_interval = 1m here) need two samples inside them.
        prometheus.wait_for("count(count_over_time(model_local_kv_nvml_up[1m]) >= 3) == 2", 30)
        yield Fleet(prometheus, instances, sidecars)


def instances_of(result: list[dict[str, object]]) -> set[str]:
    return {str(sample["metric"]["instance"]) for sample in result}  # type: ignore[index]


def test_variables_offer_each_host_and_chain_on_the_instance(fleet: Fleet) -> None:
    everything = selection(fleet.prometheus)
    offered = {v["name"]: variable_values(fleet.prometheus, v, everything) for v in query_variables()}
    assert offered["job"] == ["kv-exporter"]
    assert offered["instance"] == sorted(fleet.instances.values())
    assert offered["model_name"] == sorted(model.model_name for model, *_ in HOSTS.values())
    for host, instance in fleet.instances.items():
        chosen = selection(fleet.prometheus, {"instance": instance})
        variables = {v["name"]: v for v in query_variables()}
        assert variable_values(fleet.prometheus, variables["model_name"], chosen) == [HOSTS[host][0].model_name]
        assert variable_values(fleet.prometheus, variables["gpu"], chosen) == ["0"]


@pytest.mark.parametrize("host", [None, *HOSTS], ids=lambda h: f"instance={h or 'All'}")
def test_every_panel_returns_its_hosts_data(fleet: Fleet, host: str | None) -> None:
    picks = {} if host is None else {"instance": fleet.instances[host]}
    expected = set(fleet.instances.values()) if host is None else {fleet.instances[host]}
    chosen = selection(fleet.prometheus, picks)
    wrong = []
    for title, expr in dashboard_targets():
        result = fleet.prometheus.query(interpolate(expr, chosen))
        if result and all("instance" not in sample["metric"] for sample in result):
            continue  # the fleet row's counts and per-model ranking: one figure over the selection
        shown = instances_of(result)
        if shown != expected:
            wrong.append(f"{title!r}: instances {sorted(shown)}, expected {sorted(expected)}: {expr}")
    assert not wrong, "\n".join(wrong)


def exported(sc: Sidecar, metric: str) -> list[float]:
    return [value for (name, _), value in sc.samples().items() if name == metric]


@pytest.mark.parametrize("host", list(HOSTS))
def test_one_instance_shows_that_sidecars_own_figures(fleet: Fleet, host: str) -> None:
    """The hosts' figures differ; with one instance selected the panels show the selected sidecar's."""
    chosen = selection(fleet.prometheus, {"instance": fleet.instances[host]})
    for metric in ("model_local_kv_gpu_memory_total_bytes", "model_local_kv_gpu_projected_peak_bytes"):
        (expr,) = [e for _, e in dashboard_targets() if e.startswith(metric + "{")]
        shown = [float(s["value"][1]) for s in fleet.prometheus.query(interpolate(expr, chosen))]
        assert shown == exported(fleet.sidecars[host], metric)
    others = [exported(sc, "model_local_kv_gpu_memory_total_bytes") for sc in fleet.sidecars.values()]
    assert others[0] != others[1], "the two hosts must differ for this test to mean anything"


def test_every_selector_filters_by_each_variable_its_family_carries(fleet: Fleet) -> None:
    """Checked against real series: a family with a `gpu` (or model_name, stage, engine) label is filtered by it."""
    unfiltered = []
    for title, expr in dashboard_targets():
        for metric, matchers in SELECTOR.findall(expr):
            labels = set(fleet.prometheus.query(f"last_over_time({metric}[1m])")[0]["metric"])
            filtered = {name for name in FILTER_VARIABLES if re.search(rf'{name}[=!]~"\${name}"', matchers)}
            missing = [name for name in FILTER_VARIABLES if name in labels and name not in filtered]
            if missing:
                unfiltered.append(f"{title!r}: {metric} not filtered by {missing}")
    assert not unfiltered, "\n".join(unfiltered)


def test_an_operators_threshold_file_adds_no_duplicate_samples(fleet: Fleet) -> None:
    effective = fleet.prometheus.wait_for("gpu:model_local_kv_headroom_margin_fraction:effective", 30)
    # The example's fleet-wide override (10 %); its scoped ones name other hosts.
    assert {(s["metric"]["instance"], float(s["value"][1])) for s in effective} == {
        (instance, 0.10) for instance in fleet.instances.values()
    }
    assert "duplicate sample" not in fleet.prometheus.log.read_text()
    assert not [r for g in fleet.prometheus.api("rules")["groups"] for r in g["rules"] if r.get("health") != "ok"]
