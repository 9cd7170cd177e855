"""An engine killed and restarted with new pids (and fewer ranks), against the real sidecar process: real engine
processes publishing through the real writer, checked by the sidecar in /proc."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.support.constants import SIMULATE_GPU
from tests.support.engine_process import engine_process
from tests.support.manifests import MODEL, ceiling_bytes, live_manifest
from tests.support.net import free_port
from tests.support.scrape import absent, manifest_states, pick, total
from tests.support.sidecar import Sidecar, sidecar


def landing(sc: Sidecar) -> str:
    status, _, body = sc.get("/")
    assert status == 200
    return body.decode()


def test_engine_restarted_with_new_pids_and_fewer_ranks(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    one_rank = ceiling_bytes(live_manifest())
    args = ("--manifest-dir", str(folder), "--engine-url", url, "--engine-timeout", "1", *SIMULATE_GPU)
    with sidecar(tmp_path, *args) as sc:
        with engine_process(folder, port, running=5, ranks=2) as first:
            s = sc.samples()
            assert manifest_states(s) == (2, 0, 0)
            assert pick(s, "model_local_kv_engine_manifests", model_name=MODEL) == 2
            assert pick(s, "model_local_kv_running_sequences", model_name=MODEL) == 5
            assert total(s, "model_local_kv_ceiling_bytes") == 2 * one_rank  # two ranks on one GPU: their bytes add up
            assert f"process {first.pid} is running" in landing(sc)

            os.kill(first.pid, signal.SIGKILL)  # a hard kill leaves its manifests behind
            first.wait(10)
            s = sc.samples()
            assert manifest_states(s) == (0, 2, 0)
            assert absent(s, "model_local_kv_ceiling_bytes")  # a dead engine's declarations do not count
            assert absent(s, "model_local_kv_engine_up")
            assert pick(s, "model_local_kv_engine_page_up", target=url) == 0
            assert landing(sc).count(f"process {first.pid} is gone") == 2

        with engine_process(folder, port, running=9, ranks=1) as second:
            assert second.pid != first.pid
            s = sc.samples()
            assert manifest_states(s) == (1, 1, 0)  # rank 0 overwritten by the new pid; rank 1 is a leftover
            assert pick(s, "model_local_kv_engine_manifests", model_name=MODEL) == 1
            assert pick(s, "model_local_kv_engine_up", model_name=MODEL) == 1
            assert pick(s, "model_local_kv_running_sequences", model_name=MODEL) == 9
            assert total(s, "model_local_kv_ceiling_bytes") == one_rank
            page = landing(sc)
            assert f"process {second.pid} is running" in page and f"process {first.pid} is gone" in page

            os.kill(second.pid, signal.SIGTERM)  # a clean exit removes its manifest
            assert second.wait(10) == 0
        assert manifest_states(sc.samples()) == (0, 1, 0)
        assert sc.stop() == 0
