"""Publishing a manifest from a runner-shaped object, and every way it must fail without getting in the way.

The runner is a plain object with the attributes the hook reads from vLLM's runner (model, configs, device);
its model is a real torch module tree whose owners declare through the protocol. Filesystem faults are real:
a read-only tmpfs, a 4 KiB tmpfs filled until ENOSPC, a file where the folder should be (root ignores file
modes, so the tmpfs mounts are used where the test may mount; otherwise the test says why it falls back).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
import torch
from torch import nn

from kv_exporter.gpu import NvmlReader, SimulatedGpu
from kv_exporter.manifest import Phase, manifest_filename, read_manifest
from kv_exporter.plugin import publish as publish_module
from kv_exporter.plugin.publish import publish
from kv_exporter.plugin.settings import HookSettings
from kv_exporter.protocol import ModelLocalKVScope, ModelLocalKVSpec, RowDriver
from tests.support.plugin_state import forget_upstream_collector, forget_warnings

MAX_NUM_SEQS = 6


def spec(name: str, rows: RowDriver = RowDriver.MAX_NUM_SEQS, **extra: Any) -> ModelLocalKVSpec:
    fixed = {"rows_fixed": 2, "rows_reason": "two buckets"} if rows is RowDriver.FIXED else {}
    return ModelLocalKVSpec(
        name=name,
        layers=2,
        kv_heads=4,
        head_dim=64,
        dtype=torch.bfloat16,
        physical_capacity_positions=10,
        capacity_source="test window",
        scope=ModelLocalKVScope.REQUEST,
        rows=rows,
        **{**fixed, **extra},
    )


class Owner(nn.Module):
    def __init__(self, *specs: Any, error: Exception | None = None) -> None:
        super().__init__()
        self.specs = list(specs)
        self.error = error

    def model_local_kv_specs(self) -> list[Any]:
        if self.error is not None:
            raise self.error
        return self.specs


def runner(model: nn.Module, device: str = "cpu", **config: Any) -> SimpleNamespace:
    return SimpleNamespace(
        model=model,
        device=torch.device(device),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
        model_config=SimpleNamespace(served_model_name=config.get("served", ["svc", "alias"]), model="/m", **{
            k: v for k, v in config.items() if k == "stage_id"
        }),
        parallel_config=SimpleNamespace(
            data_parallel_rank=config.get("dp_rank", 0),
            data_parallel_index=config.get("dp_index", 0),
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
        ),
    )  # fmt: skip


def two_owner_model() -> nn.Module:
    model = nn.Module()
    model.talker = nn.Module()
    model.talker.decoder = Owner(spec("request_cache"), spec("graph_pool", RowDriver.FIXED))
    model.encoder = Owner(spec("session_cache", RowDriver.FIXED))
    return model


def settings_for(folder: Path | str, explicit: bool = True, collector: str = "kv_exporter") -> HookSettings:
    return HookSettings(disabled=False, directory=Path(folder), explicit_directory=explicit, collector=collector)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.fixture(autouse=True)
def fresh_state(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    forget_warnings()
    forget_upstream_collector()
    caplog.set_level(logging.INFO)
    yield
    publish_module._cleanup.owned.clear()


def mount_tmpfs(folder: Path, options: str) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)]).returncode == 0


@pytest.fixture
def readonly_folder(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = mount_tmpfs(folder, "ro,size=4k")
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("root without mount privilege: no folder here is unwritable to this process")
        folder.chmod(0o555)
    yield folder
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)
    else:
        folder.chmod(0o755)


@pytest.fixture
def full_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 4 KiB tmpfs filled to the last byte; without mount privilege, a folder whose fsync reports ENOSPC."""
    folder = tmp_path / "full"
    folder.mkdir()
    mounted = mount_tmpfs(folder, "size=4k")
    if mounted:
        fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 512)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
    else:

        def no_space(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr("kv_exporter.manifest.os.fsync", no_space)
    yield folder
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)


def test_publishes_every_declaration_with_identity(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = publish(runner(two_owner_model(), stage_id=2, dp_index=3, dp_rank=1), Phase.LOAD, settings_for(tmp_path))
    assert path is not None
    manifest = read_manifest(path)  # the sidecar's strict reader accepts it
    assert path.name == manifest_filename(manifest.engine)
    assert (manifest.engine.model_name, manifest.engine.stage, manifest.engine.engine_index) == ("svc", 2, 3)
    assert manifest.engine.data_parallel_rank == 1
    assert (manifest.phase, manifest.collector, manifest.max_num_seqs) == (Phase.LOAD, "kv_exporter", MAX_NUM_SEQS)
    assert manifest.process.pid == os.getpid()
    assert [(d.owner, d.name) for d in manifest.declarations] == [
        ("talker.decoder", "request_cache"),
        ("talker.decoder", "graph_pool"),
        ("encoder", "session_cache"),
    ]
    per_row = 2 * 2 * 4 * 64 * 10 * 2
    assert [d.bytes_per_row for d in manifest.declarations] == [per_row] * 3
    assert manifest.declared_peak_bytes() == per_row * (MAX_NUM_SEQS + 2 + 2)
    summary = [r.getMessage() for r in caplog.records if "kv-exporter [load]" in r.getMessage()]
    assert len(summary) == 1 and f"({per_row * 10} B) across 3 declaration(s) at max_num_seqs=6" in summary[0]
    assert any("talker.decoder.graph_pool" in r.getMessage() and "fixed(2; two buckets)" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_the_pod_the_deploy_manifests_name_is_in_the_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_EXPORTER_POD_NAME", "engine-0")
    monkeypatch.setenv("KV_EXPORTER_POD_NAMESPACE", "serving")
    monkeypatch.setenv("KV_EXPORTER_CONTAINER_NAME", "vllm")
    path = publish(runner(two_owner_model()), Phase.LOAD, settings_for(tmp_path))
    assert path is not None
    pod = read_manifest(path).pod
    assert (pod.name, pod.namespace, pod.container) == ("engine-0", "serving", "vllm")


def test_the_replica_of_a_vllm_omni_stage_is_the_engine_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "4")
    path = publish(runner(two_owner_model(), stage_id=1, dp_index=0), Phase.WARMUP, settings_for(tmp_path))
    assert path is not None
    manifest = read_manifest(path)
    assert (manifest.engine.stage, manifest.engine.engine_index, manifest.phase) == (1, 4, Phase.WARMUP)


def test_warmup_overwrites_the_load_file(tmp_path: Path) -> None:
    model = two_owner_model()
    first = publish(runner(model), Phase.LOAD, settings_for(tmp_path))
    model.late = Owner(spec("late"))
    second = publish(runner(model), Phase.WARMUP, settings_for(tmp_path))
    assert first == second and second is not None
    assert [p.name for p in tmp_path.iterdir()] == [second.name]  # no temporary file left over
    manifest = read_manifest(second)
    assert manifest.phase is Phase.WARMUP and manifest.declarations[-1].owner == "late"


def test_a_raising_declaration_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = two_owner_model()
    model.encoder.error = RuntimeError("declaration bug")
    path = publish(runner(model), Phase.LOAD, settings_for(tmp_path))
    assert path is not None
    assert {d.name for d in read_manifest(path).declarations} == {"request_cache", "graph_pool"}
    assert any("declaration bug" in message for message in warnings_of(caplog))


def test_an_unconvertible_or_repeated_declaration_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    odd = SimpleNamespace(**{**vars(spec("odd")), "dtype": "complex64"})  # a duck-typed spec with a non-KV dtype
    model = nn.Module()
    model.owner = Owner(spec("same"), spec("same"), odd)
    path = publish(runner(model), Phase.LOAD, settings_for(tmp_path))
    assert path is not None
    assert [d.name for d in read_manifest(path).declarations] == ["same"]
    assert len(warnings_of(caplog)) == 2


def test_unwritable_folder_warns_once_and_returns(readonly_folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = readonly_folder / "manifests"
    for phase in (Phase.LOAD, Phase.WARMUP):
        assert publish(runner(two_owner_model()), phase, settings_for(target)) is None
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and "cannot write the manifest" in warnings[0], warnings
    assert not target.exists()


def test_a_file_where_the_folder_should_be(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "kv-exporter"
    blocker.write_text("not a folder")
    assert publish(runner(two_owner_model()), Phase.LOAD, settings_for(blocker)) is None
    assert publish(runner(two_owner_model()), Phase.LOAD, settings_for(blocker / "below")) is None
    assert blocker.read_text() == "not a folder"
    assert all("cannot write the manifest" in w for w in warnings_of(caplog)) and warnings_of(caplog)


def test_a_full_disk(full_folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = sorted(p.name for p in full_folder.iterdir())
    assert publish(runner(two_owner_model()), Phase.LOAD, settings_for(full_folder)) is None
    [warning] = warnings_of(caplog)
    assert "No space left on device" in warning
    assert sorted(p.name for p in full_folder.iterdir()) == before  # the temporary file was removed


def test_the_default_folder_falls_back_when_not_permitted(
    readonly_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = publish(runner(two_owner_model()), Phase.LOAD, settings_for(readonly_folder / "x", explicit=False))
    assert path is not None and path.parent == tmp_path / "tmp" / "kv-exporter"
    [warning] = warnings_of(caplog)
    assert "wrote" in warning and str(path) in warning


def test_disabled_publishes_nothing(tmp_path: Path) -> None:
    disabled = HookSettings(disabled=True, directory=tmp_path, explicit_directory=True, collector="auto")
    assert publish(runner(two_owner_model()), Phase.LOAD, disabled) is None
    assert list(tmp_path.iterdir()) == []


def test_settings_from_the_environment() -> None:
    assert HookSettings.from_environ({}).directory == Path("/run/kv-exporter")
    assert HookSettings.from_environ({}).explicit_directory is False
    assert HookSettings.from_environ({"KV_EXPORTER_DIR": "/x"}) == HookSettings(False, Path("/x"), True, "auto")
    assert HookSettings.from_environ({"KV_EXPORTER_DISABLE": "1"}).disabled
    assert HookSettings.from_environ({"KV_EXPORTER_DISABLE": "TRUE"}).disabled
    assert not HookSettings.from_environ({"KV_EXPORTER_DISABLE": "0"}).disabled
    assert HookSettings.from_environ({"KV_EXPORTER_COLLECTOR": "kv_exporter"}).collector == "kv_exporter"
    assert HookSettings.from_environ({"KV_EXPORTER_COLLECTOR": "bogus"}).collector == "auto"
    assert HookSettings.from_environ({}).observe_peak  # followed unless turned off
    for off in ("0", "false", " OFF ", "no"):
        assert not HookSettings.from_environ({"KV_EXPORTER_OBSERVE_PEAK": off}).observe_peak, off
    assert HookSettings.from_environ({"KV_EXPORTER_OBSERVE_PEAK": "1"}).observe_peak


class LibraryNotFound:
    """The pynvml API where the driver library is absent: nvmlInit raises the real binding's error class."""

    NVMLError = pynvml.NVMLError

    def nvmlInit(self) -> None:
        raise pynvml.NVMLError_LibraryNotFound()


def test_nvml_missing_leaves_the_baseline_empty(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reader = NvmlReader(lib=LibraryNotFound())
    for phase in (Phase.LOAD, Phase.WARMUP):
        path = publish(runner(two_owner_model(), device="cuda:0"), phase, settings_for(tmp_path), reader)
        assert path is not None
    manifest = read_manifest(path)
    assert (manifest.device.kind, manifest.device.index) == ("cuda", 0)
    assert manifest.baseline.nvml_process_used_bytes is None
    assert manifest.baseline.torch_reserved_bytes is None  # CUDA never initialised here
    [warning] = warnings_of(caplog)
    assert "NVML unavailable (library_not_found)" in warning


def test_nvml_missing_on_this_machine(tmp_path: Path) -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVML driver")
    path = publish(runner(two_owner_model(), device="cuda:0"), Phase.LOAD, settings_for(tmp_path))
    assert path is not None and read_manifest(path).baseline.nvml_process_used_bytes is None


def test_gpu_baseline_through_the_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # cuda:1 is the second visible device; CUDA_VISIBLE_DEVICES maps it to physical index 3.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,3")
    gpu = SimulatedGpu(total=80 << 30, used=10 << 30, index=3, uuid="GPU-1234-abcd", processes={os.getpid(): 7 << 30})
    path = publish(runner(two_owner_model(), device="cuda:1"), Phase.LOAD, settings_for(tmp_path), gpu)
    assert path is not None
    manifest = read_manifest(path)
    assert (manifest.device.index, manifest.device.uuid) == (3, "GPU-1234-abcd")
    assert manifest.baseline.nvml_process_used_bytes == 7 << 30


def test_a_uuid_entry_is_resolved_to_nvmls_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234")  # CUDA accepts a unique UUID prefix
    gpu = SimulatedGpu(total=80 << 30, used=1 << 30, index=2, uuid="GPU-1234-abcd", processes={})
    path = publish(runner(two_owner_model(), device="cuda:0"), Phase.LOAD, settings_for(tmp_path), gpu)
    assert path is not None
    manifest = read_manifest(path)
    assert (manifest.device.index, manifest.device.uuid) == (2, "GPU-1234")
    assert manifest.baseline.nvml_process_used_bytes is None  # this pid holds nothing there


@pytest.mark.parametrize("recorded", [True, False], ids=["default", "KV_EXPORTER_STEP_RECORD=0"])
def test_the_step_record_beside_the_manifest_and_its_clean_exit(tmp_path: Path, recorded: bool) -> None:
    steps: list[object] = []
    worker = runner(two_owner_model())
    worker.execute_model = steps.append  # a runner's step: what the hook wraps on the instance
    settings = HookSettings(disabled=False, directory=tmp_path, explicit_directory=True, collector="kv_exporter",
                            step_record=recorded)  # fmt: skip
    path = publish(worker, Phase.LOAD, settings)
    assert path is not None and publish(worker, Phase.WARMUP, settings) == path
    record = path.with_suffix(".steps")
    assert record.exists() == recorded
    worker.execute_model(SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1}))
    assert len(steps) == 1
    publish_module._cleanup.run()
    assert not path.exists() and not record.exists()


def test_step_recording_is_on_unless_turned_off() -> None:
    assert HookSettings.from_environ({}).step_record
    assert not HookSettings.from_environ({"KV_EXPORTER_STEP_RECORD": "0"}).step_record


def test_clean_exit_removes_only_our_own_file(tmp_path: Path) -> None:
    ours = publish(runner(two_owner_model()), Phase.LOAD, settings_for(tmp_path / "a"))
    replaced = publish(runner(two_owner_model()), Phase.LOAD, settings_for(tmp_path / "b"))
    assert ours is not None and replaced is not None
    # Another process (a restarted engine) has since written the second file.
    data = json.loads(replaced.read_text())
    data["process"]["pid"] = os.getpid() + 100_000
    replaced.write_text(json.dumps(data))
    publish_module._cleanup.run()
    assert not ours.exists() and replaced.exists()


def test_a_forked_child_removes_nothing(tmp_path: Path) -> None:
    path = publish(runner(two_owner_model()), Phase.LOAD, settings_for(tmp_path))
    assert path is not None
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's own exit status is the assertion
        publish_module._cleanup.run()
        os._exit(0)
    os.waitpid(child, 0)
    assert path.exists()


def test_a_child_forked_while_the_sampler_writes_can_still_publish() -> None:
    """The sampler's thread holds the publish lock while it rewrites the manifests; a child forked then (a compile
    worker) has no such thread, so an inherited held lock would make its first publish wait for ever."""
    published = publish_module._Published()  # its own instance: the module's may be in use by other tests
    held, release = threading.Event(), threading.Event()

    def sampler_writing() -> None:
        with published.lock:
            held.set()
            release.wait(10)

    writer = threading.Thread(target=sampler_writing)
    writer.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: take the lock as publish does, or say it could not
            os._exit(0 if published.lock.acquire(timeout=2) else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        writer.join(10)
    assert os.waitstatus_to_exitcode(status) == 0
