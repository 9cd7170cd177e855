"""Every error counter of the real sidecar process exists before its first increment: exported at 0 for each reason it
can take (per configured target for engine pages) from the first scrape, so `increase()` sees the first error.
(Before, a counter appeared only with its first error: an alert on its increase could never see that one.)"""

from __future__ import annotations

from pathlib import Path

from kv_exporter.gpu import NVML_ERROR_REASONS
from kv_exporter.manifest import write_manifest
from kv_exporter.sidecar.engine_page import PAGE_ERROR_REASONS
from kv_exporter.sidecar.inputs import MANIFEST_ERROR_REASONS, OBSERVATION_ERROR_REASONS
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.support.manifests import MODEL, live_manifest
from tests.support.net import closed_port_url
from tests.support.pages import vllm_page_with
from tests.support.scrape import Samples
from tests.support.sidecar import sidecar


def counter(samples: Samples, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    """The samples of counter `name` by the values of its labels `keys`."""
    found = {}
    for (sample, labels), value in samples.items():
        if sample == name:
            by_name = dict(labels)
            assert set(by_name) == set(keys), labels
            found[tuple(by_name[key] for key in keys)] = value
    return found


def test_every_error_counter_starts_at_zero_for_each_reason(tmp_path: Path) -> None:
    write_manifest(tmp_path / "m", live_manifest())
    with SimulatedEngine(vllm_page_with(3, MODEL)) as engine:
        down = closed_port_url()
        targets = ("--engine-url", engine.url, "--engine-url", down)
        # No --simulate-gpu: the real NVML binding on a machine without a driver, which fails on every scrape.
        with sidecar(tmp_path, "--manifest-dir", str(tmp_path / "m"), *targets) as sc:
            first = sc.samples()
            assert counter(first, "model_local_kv_manifest_errors_total", "reason") == dict.fromkeys(
                ((r,) for r in MANIFEST_ERROR_REASONS), 0
            )
            assert counter(first, "model_local_kv_observation_errors_total", "reason") == dict.fromkeys(
                ((r,) for r in OBSERVATION_ERROR_REASONS), 0
            )
            pages = counter(first, "model_local_kv_engine_page_errors_total", "target", "reason")
            assert pages == {
                (t, r): int(t == down and r == "unreachable") for t in (engine.url, down) for r in PAGE_ERROR_REASONS
            }
            nvml = counter(first, "model_local_kv_nvml_errors_total", "reason")
            assert set(nvml) == {(r,) for r in NVML_ERROR_REASONS}
            assert {reason for (reason,), value in nvml.items() if value} == {"library_not_found"}

            (tmp_path / "m" / "bad.json").write_text("{")
            second = sc.samples()
            manifest_errors = counter(second, "model_local_kv_manifest_errors_total", "reason")
            assert {reason for (reason,), value in manifest_errors.items() if value} == {"invalid_json"}
            assert manifest_errors[("invalid_json",)] == 1
            assert sc.stop() == 0
