"""The server's fast exposition prints exactly what prometheus_client's encoders print, or declines."""

from __future__ import annotations

import gzip
import math
import threading
from collections.abc import Iterable
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from kv_exporter.manifest import write_manifest
from kv_exporter.reference import QWEN3_TTS
from kv_exporter.sidecar.app import ExporterApp
from kv_exporter.sidecar.collection import Collection, CollectionSettings
from kv_exporter.sidecar.engine_page import EngineTarget
from kv_exporter.sidecar.exposition import CounterRows, Exposition, Fixed, GaugeRows
from kv_exporter.sidecar.simulated_engine import SimulatedEngine
from tests.support.manifests import reference_manifest
from tests.support.pages import vllm_page_with

ACCEPTS = (
    "",
    "text/plain;version=0.0.4",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text;version=1.0.0",
    "application/openmetrics-text",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    # What Prometheus 2.42 sends.
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
)

label_names = st.sampled_from(["model_name", "UUID", "gpu", "cache", "a", "_x", "owner"])
label_values = st.text(alphabet=st.sampled_from(["a", "Z", "0", " ", '"', "\\", "\n", "é", "{", "}", ","]), max_size=8)
values = st.one_of(
    st.integers(min_value=0, max_value=2**53),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 0.0, -0.0, 1, 1.0, 4653056, 147456000, 1e-9]),
)
docs = st.text(alphabet=st.sampled_from(["d", " ", '"', "\\", "\n", "é"]), max_size=12)


@st.composite
def families(draw: st.DrawFn) -> list[Metric]:
    result: list[Metric] = []
    for i in range(draw(st.integers(1, 4))):
        names = draw(st.lists(label_names, unique=True, max_size=4))
        kind = draw(st.sampled_from([GaugeMetricFamily, CounterMetricFamily, GaugeRows, CounterRows]))
        family = kind(f"family_{i}", draw(docs), labels=names)
        for labels in draw(st.lists(st.tuples(*[label_values for _ in names]), unique=True, max_size=5)):
            family.add_metric(list(labels), draw(values))
        result.append(family)
    return result


def expected(metrics: list[Metric], accept: str) -> tuple[bytes, str]:
    encoder, content_type = choose_encoder(accept)
    return encoder(Fixed(metrics)), content_type


@settings(max_examples=300, deadline=None)
@given(families(), families(), st.sampled_from(ACCEPTS))
def test_same_bytes_as_prometheus_client_also_from_the_cache(
    first: list[Metric], second: list[Metric], accept: str
) -> None:
    exposition = Exposition()
    for metrics in (first, first, second, first):  # cold, warm, changed, and back
        want, content_type = expected(metrics, accept)
        # An empty label value outside GaugeRows is left to prometheus_client, which prints it.
        declines = any("" in s.labels.values() for m in metrics if not isinstance(m, GaugeRows) for s in m.samples)
        assert exposition.render(metrics, content_type) == (None if declines else want)


def test_a_real_page_is_reproduced() -> None:
    gauge = GaugeRows("model_local_kv_ceiling_bytes", 'Bytes "at" max\\rows', labels=["UUID", "cache"])
    gauge.add_metric(["GPU-1", 'a"b\\c\nd'], 4653056 * 256)
    gauge.add_metric(["GPU-2", ""], 0)
    counter = CounterMetricFamily("model_local_kv_manifest_errors", "Invalid.", labels=["reason"])
    counter.add_metric(["too_large"], 3)
    bare = GaugeMetricFamily("model_local_kv_nvml_up", "1 if up.", value=1)
    for accept in ACCEPTS:
        want, content_type = expected([gauge, counter, bare], accept)
        assert Exposition().render([gauge, counter, bare], content_type) == want


def test_empty_labels_are_left_out_of_rows_families() -> None:
    """A worker without pod information exports no pod="" (an empty label would delete the target's own under
    honor_labels), in both encoders; other families keep prometheus_client's spelling by declining."""
    gauge = GaugeRows("model_local_kv_engine_up", "doc", labels=["model_name", "pod", "namespace", "container"])
    gauge.add_metric(["tts", "", "", ""], 1)
    gauge.add_metric(["tts", "tts-0", "serving", ""], 1)
    for accept in ACCEPTS:
        want, content_type = expected([gauge], accept)
        page = Exposition().render([gauge], content_type)
        assert page == want
        assert b'=""' not in page
        assert b'model_local_kv_engine_up{model_name="tts"} 1' in page
        assert b'{model_name="tts",namespace="serving",pod="tts-0"} 1' in page
    counter = CounterMetricFamily("c", "doc", labels=["reason"])
    counter.add_metric([""], 1)
    assert Exposition().render([counter], choose_encoder("")[1]) is None
    rows = CounterRows("model_local_kv_observed_cuda_ooms", "doc", labels=["model_name", "pod"])
    rows.add_metric(["tts", ""], 1)
    for accept in ACCEPTS:
        want, content_type = expected([rows], accept)
        page = Exposition().render([rows], content_type)
        assert page == want and b'model_local_kv_observed_cuda_ooms_total{model_name="tts"} 1' in page


def test_declines_what_it_does_not_cover() -> None:
    gauge = GaugeMetricFamily("g", "doc", labels=["a"])
    gauge.add_metric(["x"], 1)
    histogram = HistogramMetricFamily("h", "doc", buckets=[("1.0", 1), ("+Inf", 2)], sum_value=3)
    with_unit = GaugeMetricFamily("u_seconds", "doc", value=1, unit="seconds")
    odd_label = GaugeMetricFamily("o", "doc", labels=["dotted.name"])
    odd_label.add_metric(["x"], 1)
    duplicate = GaugeRows("d", "doc", labels=["a", "a"])
    duplicate.add_metric(["x", "y"], 1)
    stamped = GaugeMetricFamily("t", "doc", labels=["a"])
    stamped.add_metric(["x"], 1, timestamp=5)
    _, plain = choose_encoder("")
    for family in (histogram, with_unit, odd_label, duplicate, stamped):
        assert Exposition().render([gauge, family], plain) is None
    _, dots = choose_encoder("text/plain;version=1.0.0;escaping=dots")
    assert Exposition().render([gauge], dots) is None
    assert Exposition().render([gauge], plain) == expected([gauge], "")[0]


def test_nan_and_negative_zero_keep_their_spelling() -> None:
    gauge = GaugeMetricFamily("g", "doc", labels=["a"])
    for i, value in enumerate((0.0, -0.0, math.nan, 0, -0.0)):
        gauge.add_metric([str(i)], value)
    _, plain = choose_encoder("")
    exposition = Exposition()
    assert exposition.render([gauge], plain) == exposition.render([gauge], plain) == expected([gauge], "")[0]


def test_rows_family_samples_are_prometheus_client_samples() -> None:
    rows = GaugeRows("r", "doc", labels=["b", "a"])
    plain = GaugeMetricFamily("r", "doc", labels=["b", "a"])
    for family in (rows, plain):
        family.add_metric(["1", "2"], 3)
        family.add_metric(["4", "5"], 6.5)
    assert rows.samples == plain.samples
    assert rows == plain
    counter_rows, counter = CounterRows("c", "doc", labels=["b"]), CounterMetricFamily("c", "doc", labels=["b"])
    for family in (counter_rows, counter):
        family.add_metric(["1"], 3)
    assert counter_rows.samples == counter.samples and counter_rows.type == counter.type == "counter"


def test_concurrent_scrapes_share_one_rendering(tmp_path: Path) -> None:
    write_manifest(tmp_path, reference_manifest(QWEN3_TTS))
    with SimulatedEngine(vllm_page_with(2, "Qwen3-TTS"), fault="slow", delay_s=0.5) as engine:
        settings = CollectionSettings(str(tmp_path), (EngineTarget.parse(engine.url),), fetch_timeout_s=3)
        app = ExporterApp(Collection(settings, None))
        rendered: list[str] = []
        render = app.exposition.chunks

        def counting(metrics: Iterable[Metric], content_type: str) -> list[bytes] | None:
            rendered.append(content_type)
            return render(metrics, content_type)

        app.exposition.chunks = counting  # type: ignore[method-assign]
        start = threading.Barrier(6)
        bodies: list[bytes] = []

        def scrape() -> None:
            start.wait()
            bodies.append(app.metrics(None, "gzip")[0])

        threads = [threading.Thread(target=scrape) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert len(bodies) == 6 and len(set(bodies)) == 1
        assert len(rendered) == 1 and engine.requests == 1
        plain = app.metrics(None, None)[0]  # another format (no gzip): its own rendering
        assert len(rendered) == 2 and gzip.decompress(bodies[0]).split(b"\n")[:2] == plain.split(b"\n")[:2]
        app.collection.close()
