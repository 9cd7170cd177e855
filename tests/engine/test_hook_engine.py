"""The hook inside a real vLLM 0.32 CPU server: what it writes, when, from which process, and that it is never
in the way. Each class starts one server (class-scoped, stopped by process group when the class ends).

The test architecture (tests/engine/testplugin) records what it declared and what its real caches hold into a
per-process report, and snapshots the manifest folder whenever it is asked for its declarations; the tests
compare the manifest with those records, and the bytes with both the real caches and the geometry.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kv_exporter
from kv_exporter.manifest import Manifest, manifest_filename, parse_manifest, read_manifest
from tests.engine.conftest import ServerFactory
from tests.engine.server import MAX_NUM_SEQS, SERVED_NAME, Server
from tests.engine.testplugin.kvx_testplugin import geometry as g
from tests.openai_server import parent_pid
from tests.support.constants import REPO, UPDATE_FIXTURES_ENV

FIXTURE = REPO / "tests" / "fixtures" / "vllm-0.32-metrics.txt"
LOAD_LINE = "kv-exporter [load]"
WARMUP_LINE = "kv-exporter [warmup]"


def row_bytes(positions: int, itemsize: int) -> int:
    """K and V, every layer, KV head and position of the side caches' geometry."""
    return 2 * g.SIDE_LAYERS * g.SIDE_KV_HEADS * g.SIDE_HEAD_DIM * positions * itemsize


def only_manifest(server: Server) -> Manifest:
    paths = server.manifests()
    assert len(paths) == 1, paths
    return read_manifest(paths[0])  # the sidecar's strict reader


def owner_calls(report: dict[str, Any], owner: str) -> list[dict[str, Any]]:
    return [call for call in report["calls"] if call["owner"] == owner]


def declared_by_model(report: dict[str, Any], owner: str, call: int) -> list[dict[str, Any]]:
    declared: list[dict[str, Any]] = owner_calls(report, owner)[call]["declared"]
    return declared


def check_declaration(manifest: Manifest, owner: str, declared: dict[str, Any], real_bytes: int | None) -> None:
    """Every field the model declared arrives unchanged; the sizes agree with the geometry and the caches."""
    [decl] = [d for d in manifest.declarations if d.owner == owner]
    fields = dataclasses.asdict(decl)
    assert fields.pop("owner") == owner
    itemsize = fields.pop("itemsize")
    assert fields == declared
    assert decl.bytes_per_row == row_bytes(decl.physical_capacity_positions, itemsize)
    if real_bytes is not None:  # a batch-1 cache holds exactly one row
        assert decl.bytes_per_row == real_bytes
    rows = decl.rows_fixed if decl.rows == "fixed" else MAX_NUM_SEQS
    assert decl.peak_bytes(manifest.max_num_seqs) == rows * decl.bytes_per_row


def log_lines(server: Server, marker: str) -> list[str]:
    return [line for line in server.log().splitlines() if marker in line]


def assert_published_once_per_phase(server: Server, pid: int) -> None:
    for marker in (LOAD_LINE, WARMUP_LINE):
        lines = log_lines(server, marker)
        assert len(lines) == 1, lines
        assert f"pid={pid})" in lines[0]


def check_identity_and_process(manifest: Manifest, writer_pid: int, started_wall: float) -> None:
    assert manifest.engine.model_name == SERVED_NAME
    assert (manifest.engine.stage, manifest.engine.engine_index) == (0, 0)
    assert (manifest.engine.data_parallel_rank, manifest.engine.tp_rank, manifest.engine.pp_rank) == (0, 0, 0)
    assert manifest.max_num_seqs == MAX_NUM_SEQS
    assert manifest.process.pid == writer_pid
    stat = Path(f"/proc/{writer_pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert manifest.process.start_time_ticks == int(stat[19])
    assert manifest.process.pid_namespace == os.readlink(f"/proc/{writer_pid}/ns/pid")
    assert manifest.process.hostname == socket.gethostname()
    assert (manifest.device.kind, manifest.device.index, manifest.device.uuid) == ("cpu", None, None)
    assert (manifest.baseline.nvml_process_used_bytes, manifest.baseline.torch_reserved_bytes) == (None, None)
    assert started_wall <= manifest.written_at <= time.time()
    assert manifest.writer_version == kv_exporter.__version__


def metric_families(page: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", page, flags=re.MULTILINE))


@pytest.fixture(scope="class")
def default_server(server_factory: ServerFactory) -> Iterator[dict[str, Any]]:
    """Default layout: API server -> engine core -> worker process; plain CPUWorker; collector auto."""
    started_wall = time.time()
    # A grace period, so vLLM stops its engine core with SIGTERM instead of SIGKILL (its default is 0 s).
    server = server_factory("default", args=["--shutdown-timeout", "10"])
    completions = server.concurrent_completions(8, max_tokens=200)
    yield {"server": server, "started_wall": started_wall, "completions": completions, "page": server.metrics_page()}


class TestDefaultLayout:
    def test_the_worker_process_writes_one_manifest(self, default_server: dict[str, Any]) -> None:
        server: Server = default_server["server"]
        manifest = only_manifest(server)
        writer = manifest.process.pid
        engine_core = parent_pid(writer)
        assert writer != server.pid and engine_core != server.pid
        assert parent_pid(engine_core) == server.pid
        assert server.manifests()[0].name == manifest_filename(manifest.engine)

    def test_every_field(self, default_server: dict[str, Any]) -> None:
        server: Server = default_server["server"]
        manifest = only_manifest(server)
        report = server.report()[manifest.process.pid]
        check_identity_and_process(manifest, manifest.process.pid, default_server["started_wall"])
        assert manifest.phase.value == "warmup"
        # vllm_omni is installed but not importable on vLLM 0.32: its collector is loaded by file path.
        assert manifest.collector == "vllm_omni"
        assert {d.owner for d in manifest.declarations} == {g.DECODER_OWNER, g.ENCODER_OWNER}
        decoder, encoder = owner_calls(report, "decoder")[-1], owner_calls(report, "encoder")[-1]
        check_declaration(manifest, g.DECODER_OWNER, decoder["declared"][0], decoder["shown_bytes"])
        check_declaration(manifest, g.ENCODER_OWNER, encoder["declared"][0], encoder["shown_bytes"])
        assert decoder["shown_bytes"] == row_bytes(g.DECODER_POSITIONS, 4)
        assert encoder["shown_bytes"] == row_bytes(g.ENCODER_CAPACITY, 2)
        # The CPU eager path runs no forward before warm-up: the live-state "graph pool" declares nothing.
        assert [call["seen"] for call in owner_calls(report, "talker")] == [[], []]

    def test_load_then_warmup_each_written_once(self, default_server: dict[str, Any]) -> None:
        server: Server = default_server["server"]
        manifest = only_manifest(server)
        talker_calls = owner_calls(server.report()[manifest.process.pid], "talker")
        assert len(talker_calls) == 2  # one collection per phase
        assert talker_calls[0]["manifests_on_disk"] == {}
        [(name, at_load)] = talker_calls[1]["manifests_on_disk"].items()
        assert name == server.manifests()[0].name
        loaded = parse_manifest(json.dumps(at_load).encode(), name)
        assert loaded.phase.value == "load"
        assert loaded.process == manifest.process
        assert loaded.declarations == manifest.declarations
        assert loaded.written_at <= manifest.written_at
        assert_published_once_per_phase(server, manifest.process.pid)

    def test_only_load_model_and_init_are_wrapped(self, default_server: dict[str, Any]) -> None:
        server: Server = default_server["server"]
        report = server.report()[only_manifest(server).process.pid]
        [methods] = owner_calls(report, "runner_methods")
        expected = ["__init__", "load_model"]
        assert methods["wrapped"] == {"CPUModelRunner": expected, "GPUModelRunner": expected}

    def test_serving_works_and_metrics_fixture(self, default_server: dict[str, Any]) -> None:
        completions = default_server["completions"]
        assert [c["usage"]["completion_tokens"] for c in completions] == [200] * 8
        page: str = default_server["page"]
        assert re.search(r'^vllm:num_requests_running\{engine="0",model_name="kvx-tiny"\} ', page, re.MULTILINE)
        if not FIXTURE.exists() or os.environ.get(UPDATE_FIXTURES_ENV) == "1":
            FIXTURE.write_text(page)
        # The saved fixture must still describe what vLLM 0.32 serves: same metric families.
        assert metric_families(page) == metric_families(FIXTURE.read_text())

    def test_clean_exit_removes_the_manifest(self, default_server: dict[str, Any]) -> None:
        server: Server = default_server["server"]
        assert server.manifests()
        assert server.stop() == 0
        assert server.manifests() == []


@pytest.fixture(scope="class")
def inproc_server(server_factory: ServerFactory) -> Iterator[dict[str, Any]]:
    """VLLM_ENABLE_V1_MULTIPROCESSING=0: the runner lives in the engine core; a runner subclass that works after
    super().load_model(); a worker that captures buckets after super(); kv_exporter's own collector."""
    started_wall = time.time()
    server = server_factory(
        "inproc",
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KV_EXPORTER_COLLECTOR": "kv_exporter"},
        args=["--worker-cls", "kvx_testplugin.worker.KvxCPUWorker"],
    )
    yield {"server": server, "started_wall": started_wall, "completion": server.completion("Hello", 8)}


class TestInProcessLayoutAndSuperChain:
    def test_the_engine_core_writes_it(self, inproc_server: dict[str, Any]) -> None:
        server: Server = inproc_server["server"]
        manifest = only_manifest(server)
        assert parent_pid(manifest.process.pid) == server.pid
        check_identity_and_process(manifest, manifest.process.pid, inproc_server["started_wall"])
        assert manifest.collector == "kv_exporter"
        assert inproc_server["completion"]["usage"]["completion_tokens"] == 8

    def test_load_manifest_written_after_the_outermost_load_model(self, inproc_server: dict[str, Any]) -> None:
        server: Server = inproc_server["server"]
        manifest = only_manifest(server)
        report = server.report()[manifest.process.pid]
        owners_in_order = [call["owner"] for call in report["calls"]]
        # The subclass attached its late owner after super().load_model(); the first collection came after.
        assert owners_in_order.index("runner") < owners_in_order.index("talker")
        [runner] = owner_calls(report, "runner")
        assert runner == {"owner": "runner", "late_attached": True, "runner_class": "KvxCPUModelRunner"}
        talker_calls = owner_calls(report, "talker")
        assert len(talker_calls) == 2
        [at_load] = talker_calls[1]["manifests_on_disk"].values()
        loaded = parse_manifest(json.dumps(at_load).encode(), "load")
        assert loaded.phase.value == "load"
        assert {d.owner for d in loaded.declarations} == {g.DECODER_OWNER, g.ENCODER_OWNER, g.LATE_OWNER}
        check_declaration(loaded, g.LATE_OWNER, declared_by_model(report, "late", 0)[0], None)
        assert_published_once_per_phase(server, manifest.process.pid)

    def test_warmup_manifest_has_what_warmup_captured(self, inproc_server: dict[str, Any]) -> None:
        server: Server = inproc_server["server"]
        manifest = only_manifest(server)
        report = server.report()[manifest.process.pid]
        assert manifest.phase.value == "warmup"
        owners = {d.owner for d in manifest.declarations}
        assert owners == {g.TALKER_OWNER, g.DECODER_OWNER, g.ENCODER_OWNER, g.LATE_OWNER}
        [worker] = owner_calls(report, "worker")
        talker_at_warmup = owner_calls(report, "talker")[1]
        assert set(worker["captured"]) == set(g.CAPTURE_SIZES) <= set(talker_at_warmup["seen"])
        check_declaration(manifest, g.TALKER_OWNER, talker_at_warmup["declared"][0], None)
        [pool] = [d for d in manifest.declarations if d.owner == g.TALKER_OWNER]
        assert pool.rows_fixed == len(talker_at_warmup["seen"])
        decoder = owner_calls(report, "decoder")[1]
        check_declaration(manifest, g.DECODER_OWNER, decoder["declared"][0], decoder["shown_bytes"])


@pytest.fixture(scope="class")
def raising_server(server_factory: ServerFactory) -> Iterator[Server]:
    yield server_factory("raising", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVX_TEST_RAISE": "encoder"})


class TestRaisingDeclaration:
    def test_load_and_serving_go_on_without_it(self, raising_server: Server) -> None:
        assert raising_server.completion("Hello", 8)["usage"]["completion_tokens"] == 8
        manifest = only_manifest(raising_server)
        assert manifest.phase.value == "warmup"
        assert {d.owner for d in manifest.declarations} == {g.DECODER_OWNER}
        assert "raises on purpose" in raising_server.log()


@pytest.fixture(scope="class")
def readonly_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder this process cannot write: a read-only tmpfs as root (root ignores modes), else mode 0555."""
    folder = tmp_path_factory.mktemp("readonly")
    mounted = False
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=4k", "tmpfs", str(folder)]).returncode == 0
        if not mounted:  # no mount privilege: a path not even root can create
            yield Path("/proc/kv-exporter-test/manifests")
            return
    else:
        folder.chmod(0o555)
    try:
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=False)
        else:
            folder.chmod(0o755)


@pytest.fixture(scope="class")
def unwritable_server(server_factory: ServerFactory, readonly_folder: Path) -> Iterator[Server]:
    yield server_factory("unwritable", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, manifest_dir=readonly_folder)


class TestUnwritableFolder:
    def test_load_and_serving_go_on_with_one_warning(self, unwritable_server: Server) -> None:
        assert unwritable_server.completion("Hello", 8)["usage"]["completion_tokens"] == 8
        assert unwritable_server.manifests() == []
        warnings = log_lines(unwritable_server, "kv-exporter: cannot write the manifest")
        assert len(warnings) == 1, warnings  # both phases failed; one warning
        assert "WARNING" in warnings[0]
        for marker in (LOAD_LINE, WARMUP_LINE):  # the summary is still logged
            [line] = log_lines(unwritable_server, marker)
            assert "manifest not written" in line
