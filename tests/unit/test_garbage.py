"""The collector policy's premise, on the real collection: a scrape frees every object it makes by reference count,
so running the cyclic collector less often (`sidecar.garbage`) delays no memory a scrape leaves behind."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

from kv_exporter.gpu import SimulatedGpu
from kv_exporter.manifest import write_manifest
from kv_exporter.reference import REFERENCE_MODELS
from kv_exporter.sidecar.app import ExporterApp
from kv_exporter.sidecar.collection import Collection, CollectionSettings
from kv_exporter.sidecar.garbage import YOUNG_THRESHOLD, collect_less_often
from tests.support.constants import GPU_TOTAL, GPU_USED, UUID0
from tests.support.manifests import reference_manifest

OPENMETRICS = "application/openmetrics-text;version=1.0.0"


def test_scrapes_leave_no_cyclic_garbage(tmp_path: Path) -> None:
    manifests = [reference_manifest(model, stage=stage) for stage, model in enumerate(REFERENCE_MODELS)]
    for manifest in manifests:
        write_manifest(tmp_path, manifest)
    gpu = SimulatedGpu(total=GPU_TOTAL, used=GPU_USED, uuid=UUID0)
    app = ExporterApp(Collection(CollectionSettings(str(tmp_path)), gpu))
    gc.disable()
    try:
        app.metrics(OPENMETRICS, "gzip")  # the first: caches made once (type hints, placed declarations) stay
        for more, (accept, encoding) in enumerate(((OPENMETRICS, "gzip"), (None, None), (OPENMETRICS, "gzip")), 1):
            # A worker rewrites its manifest (json's own encoder leaves cycles: the writer's, not the scrape's);
            # the scrape parses it again and drops the old one.
            write_manifest(tmp_path, dataclasses.replace(manifests[0], max_num_seqs=manifests[0].max_num_seqs + more))
            gc.collect()
            app.metrics(accept, encoding)
            assert gc.collect() == 0
    finally:
        gc.enable()
        app.collection.close()


def test_serving_raises_only_the_young_threshold() -> None:
    before = gc.get_threshold()
    try:
        collect_less_often()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
    finally:
        gc.set_threshold(*before)
