"""The whole chain, end to end: a real vLLM engine on CPU with the plugin (tests/engine's environment) writes
manifests; real kv-exporter sidecars read them and the engine's real metrics page; a real Prometheus scrapes the
sidecars and evaluates the shipped rules. Everything is asserted through Prometheus' HTTP API.

Two sidecars read the same engine, each with a simulated GPU (the only simulated part): "roomy" has memory to
spare, "tight" is set so that the projected peak exceeds its total. The projected-peak alert must fire for
"tight" only. Its `for: 5m` is shortened to 0s in the copy of the rules this test loads; the expression is
the shipped one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from kv_exporter.manifest import Manifest, read_manifest
from tests.deploy.grafana import panels_without_data
from tests.deploy.helpers import (
    RULES,
    Prometheus,
    prometheus_config,
    start_prometheus,
)
from tests.engine.server import MAX_NUM_SEQS, SERVED_NAME, VLLM_PYTHON, Server, start_server
from tests.engine.tinymodel import build_model
from tests.loadgen import CompletionClients
from tests.support.constants import GIB
from tests.support.sidecar import Sidecar, start_sidecar, stop_process

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.engine,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (run `make engine-env`)"),
]

ALERT = "ModelLocalKVProjectedPeakAboveGPUMemory"
LOAD_S = 8.0  # at least; on until Prometheus has BUSY_SAMPLES scrapes that saw sequences running
BUSY_SAMPLES = 3
MAX_LOAD_S = 90.0
LOAD_CONCURRENCY = 8
LOAD_TOKENS = 200
SCRAPE_INTERVAL_S = 1.0  # prometheus_config's, also its scrape timeout
ENGINE_TIMEOUT_S = 0.5


def final_manifests(server: Server, timeout: float = 120) -> list[Manifest]:
    """The engine's manifests once every one has been rewritten after warm-up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        manifests = [read_manifest(p) for p in server.manifests()]
        if manifests and all(m.phase.value == "warmup" for m in manifests):
            return manifests
        time.sleep(0.5)
    pytest.fail(f"no warm-up manifests in {server.manifest_dir} after {timeout}s:\n{server.log()[-3000:]}")


@dataclass
class Chain:
    server: Server
    manifests: list[Manifest]
    sidecars: dict[str, str]  # name -> listen address (Prometheus' instance label)
    prometheus: Prometheus
    load_started: float
    load_finished: float


def scaling_ceiling(manifests: list[Manifest]) -> int:
    return sum(
        d.peak_bytes(m.max_num_seqs) for m in manifests for d in m.declarations if d.rows.scales_with_max_num_seqs
    )


def rules_with_immediate_alert() -> str:
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == ALERT:
                rule["for"] = "0s"
    return str(yaml.safe_dump(rules, sort_keys=False))


def run_load(server: Server, busy_samples: Callable[[], int]) -> None:
    """Keep the engine busy with a plain loop of clients, each sending one completion after another (a burst of
    tiny-model completions ends within one scrape interval), for LOAD_S and on until `busy_samples()` reaches
    BUSY_SAMPLES, at most MAX_LOAD_S. The clients run in a process of their own: as 8 threads of this process they
    kept 0-3 sequences in the engine at most instants, and 3 scrapes seeing any took 58 s. This load once left every
    scrape reading 0 while the running count came from vLLM's own page (its API server, busy with the streams,
    answered seconds late); the worker's step record does not depend on that server."""
    # Different lengths per client keep the requests from ending together, between two scrapes.
    with CompletionClients(server, SERVED_NAME, LOAD_CONCURRENCY, LOAD_TOKENS, tokens_step=-9) as load:
        started = time.monotonic()
        while (ran := time.monotonic() - started) < MAX_LOAD_S and (ran < LOAD_S or busy_samples() < BUSY_SAMPLES):
            assert load.running(), "the clients' process ended"
            time.sleep(0.5)
    assert not load.errors, load.errors[:3]
    assert load.completed >= LOAD_CONCURRENCY


def busy_samples(prometheus: Prometheus, address: str) -> Callable[[], int]:
    """How many scrapes of the sidecar at `address` Prometheus has stored with sequences running, so far."""
    seen: set[str] = set()
    running = selector("model_local_kv_running_sequences", address)

    def count() -> int:
        for sample in prometheus.query(f"timestamp({running}) and {running} > 0"):  # the scrape's own time
            seen.add(sample["value"][1])
        return len(seen)

    return count


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    workdir = tmp_path_factory.mktemp("chain")
    model = build_model(tmp_path_factory.mktemp("chain-model"))
    # The peak is followed by default, so the dashboard's peak panel has its series too.
    server = start_server(workdir / "engine", model, args=["--shutdown-timeout", "10"])
    sidecars: list[Sidecar] = []
    try:
        server.wait_ready()
        manifests = final_manifests(server)
        # A deliberately broken manifest beside the real ones: the error counter and its panel get data.
        (server.manifest_dir / "broken-by-test.json").write_text('{"schema_version": 1, "truncated": ')
        ceiling = scaling_ceiling(manifests)
        assert ceiling > 0, "the test model declares max_num_seqs-driven caches"
        # tight: idle, the projected peak is used + the whole scaling ceiling, half a ceiling above total.
        tight_total = 4 * GIB
        sims = {"roomy": f"{80 * GIB}:{1 * GIB}", "tight": f"{tight_total}:{tight_total - ceiling // 2}"}
        for simulate in sims.values():
            # The engine's page as a cross-check, read within the scrape timeout as --engine-timeout asks (a busy
            # API server's page then fails, counted); the running count is the worker's step record's.
            args = (
                f"--manifest-dir={server.manifest_dir}",
                f"--engine-url={server.url('/metrics')}",
                f"--engine-timeout={ENGINE_TIMEOUT_S:g}",
                f"--running-window={SCRAPE_INTERVAL_S:g}",
            )
            sidecars.append(start_sidecar(workdir, *args, f"--simulate-gpu={simulate}"))
        addresses = {name: sc.address for name, sc in zip(sims, sidecars, strict=True)}
        config = prometheus_config(list(addresses.values()), f"{SCRAPE_INTERVAL_S:g}s")
        rules = {RULES.name: rules_with_immediate_alert()}
        with start_prometheus(workdir / "prometheus", config, rules) as prometheus:
            prometheus.wait_for('up{job="kv-exporter"} == 1', 30)
            prometheus.wait_for("count_over_time(model_local_kv_running_sequences[1m]) >= 3", 30)
            load_started = time.time()
            run_load(server, busy_samples(prometheus, addresses["roomy"]))
            load_finished = time.time()
            time.sleep(3)  # a few idle scrapes after the load
            yield Chain(server, manifests, addresses, prometheus, load_started, load_finished)
    finally:
        for sc in sidecars:
            stop_process(sc.process)
        server.stop()


def series(chain: Chain, expr: str) -> list[tuple[float, float]]:
    """(time, value) samples of a one-series expression over the load window, at the scrape interval."""
    data = chain.prometheus.api(
        "query_range",
        query=expr,
        start=str(chain.load_started - 5),
        end=str(chain.load_finished + 3),
        step="1",
    )
    result: list[dict[str, Any]] = data["result"]
    assert len(result) == 1, f"{expr}: {len(result)} series"
    return [(float(t), float(v)) for t, v in result[0]["values"]]


def selector(metric: str, address: str) -> str:
    return f'{metric}{{instance="{address}", model_name="{SERVED_NAME}"}}'


def roomy(metric: str, chain: Chain) -> str:
    return selector(metric, chain.sidecars["roomy"])


def test_running_count_rises_under_load(chain: Chain) -> None:
    running = [v for _, v in series(chain, roomy("model_local_kv_running_sequences", chain))]
    assert max(running) > 0, running
    assert max(running) <= MAX_NUM_SEQS
    assert running[0] == 0 and running[-1] == 0, "idle before and after the load"


def test_the_window_s_most_holds_every_running_count(chain: Chain) -> None:
    running = dict(series(chain, roomy("model_local_kv_running_sequences", chain)))
    most = dict(series(chain, roomy("model_local_kv_running_sequences_max", chain)))
    both = sorted(set(running) & set(most))
    assert both and max(most.values()) > 0
    assert all(most[t] >= running[t] for t in both), [(t, running[t], most[t]) for t in both if most[t] < running[t]]
    (state,) = chain.prometheus.query(roomy("model_local_kv_running_state", chain).replace("}", ', state="idle"}'))
    assert state["value"][1] == "1", "idle after the load"


def expected_estimate(manifests: list[Manifest], running: int) -> int:
    return sum(
        d.rows_at(min(running, manifest.max_num_seqs)) * d.bytes_per_row
        for manifest in manifests
        for d in manifest.declarations
    )


def test_estimate_follows_the_running_count(chain: Chain) -> None:
    running = dict(series(chain, roomy("model_local_kv_running_sequences", chain)))
    estimate = dict(series(chain, f"sum({roomy('model_local_kv_estimated_bytes', chain)})"))
    both = sorted(set(running) & set(estimate))
    assert both
    for t in both:
        assert estimate[t] == expected_estimate(chain.manifests, int(running[t])), f"at {t}"
    busy = [estimate[t] for t in both if running[t] > 0]
    idle = [estimate[t] for t in both if running[t] == 0]
    assert busy and idle and min(busy) > max(idle)


def test_ceiling_equals_the_declarations_at_max_num_seqs(chain: Chain) -> None:
    for manifest in chain.manifests:
        for d in manifest.declarations:
            selector = f'owner="{d.owner}", cache="{d.name}", instance="{chain.sidecars["roomy"]}"'
            (sample,) = chain.prometheus.query(f"model_local_kv_ceiling_bytes{{{selector}}}")
            assert int(float(sample["value"][1])) == d.peak_bytes(manifest.max_num_seqs), d
    (total,) = chain.prometheus.query(f"sum({roomy('model_local_kv_ceiling_bytes', chain)})")
    assert int(float(total["value"][1])) == sum(m.declared_peak_bytes() for m in chain.manifests)
    (seqs,) = chain.prometheus.query(roomy("model_local_kv_max_num_seqs", chain))
    assert int(float(seqs["value"][1])) == MAX_NUM_SEQS


def test_every_dashboard_query_returns_data(chain: Chain) -> None:
    missing = panels_without_data(chain.prometheus, 30)
    assert not missing, "panels without data:\n" + "\n".join(missing)


def test_projected_peak_alert_fires_only_where_it_is_true(chain: Chain) -> None:
    firing = chain.prometheus.wait_for(f'ALERTS{{alertname="{ALERT}", alertstate="firing"}}', 30)
    assert {s["metric"]["instance"] for s in firing} == {chain.sidecars["tight"]}
    # The roomy device: the same expression holds nowhere.
    assert not chain.prometheus.query(
        f'model_local_kv_gpu_projected_peak_bytes{{instance="{chain.sidecars["roomy"]}"}}'
        f" > model_local_kv_gpu_memory_total_bytes"
    )
    (alert,) = chain.prometheus.firing(ALERT)
    assert alert["labels"]["severity"] == "critical" and alert["labels"]["source"] == "simulated"
