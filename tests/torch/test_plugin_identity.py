"""Engine identity and device mapping as the hook reads them from a runner (no vLLM, no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kv_exporter.manifest import DeviceInfo, PodInfo
from kv_exporter.plugin import identity
from kv_exporter.plugin.identity import VisibleDevice, map_visible_ordinal, parse_visible_devices


@pytest.mark.parametrize(
    ("text", "ordinal", "expected"),
    [
        (None, 3, VisibleDevice(index=3)),  # unset: every device, in order
        ("2,3", 1, VisibleDevice(index=3)),
        (" 4 , 6 ", 1, VisibleDevice(index=6)),
        ("GPU-8a1b,GPU-77ee", 1, VisibleDevice(uuid="GPU-77ee")),
        ("MIG-3f0c-11aa", 0, VisibleDevice(uuid="MIG-3f0c-11aa")),
        ("MIG-GPU-5d1e/1/0", 0, VisibleDevice(uuid="MIG-GPU-5d1e/1/0")),
        ("1,GPU-99", 1, VisibleDevice(uuid="GPU-99")),
        ("0,-1,2", 1, VisibleDevice()),  # CUDA stops at the first invalid entry: only device 0 is visible
        ("", 0, VisibleDevice()),  # empty: no device visible
        ("2,3", 2, VisibleDevice()),  # past the list
        ("NoDevFiles", 0, VisibleDevice()),
    ],
)
def test_visible_ordinal_to_physical(text: str | None, ordinal: int, expected: VisibleDevice) -> None:
    assert map_visible_ordinal(ordinal, text) == expected


def test_parse_visible_devices_stops_at_the_first_invalid_entry() -> None:
    assert parse_visible_devices("3,x,1") == [VisibleDevice(index=3)]
    assert parse_visible_devices(None) is None


def runner(**parts: object) -> SimpleNamespace:
    return SimpleNamespace(**parts)


def test_served_model_name_is_the_first_served_name_or_the_path() -> None:
    assert identity.served_model_name(SimpleNamespace(served_model_name=["a", "b"], model="/m")) == "a"
    assert identity.served_model_name(SimpleNamespace(served_model_name="svc", model="/m")) == "svc"
    assert identity.served_model_name(SimpleNamespace(served_model_name=None, model="/m")) == "/m"
    assert identity.served_model_name(None) == "unknown"


def test_identity_reads_the_vllm_config_when_the_runner_lacks_an_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_OMNI_REPLICA_ID", raising=False)
    config = SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="svc", stage_id=3),
        parallel_config=SimpleNamespace(data_parallel_rank=0, data_parallel_index=2),
        scheduler_config=SimpleNamespace(max_num_seqs=0),
    )
    found = identity.engine_identity(runner(vllm_config=config))
    # Dense models reset data_parallel_rank to 0 and keep the index, which is vLLM's `engine` label.
    assert (found.model_name, found.stage, found.engine_index, found.data_parallel_rank) == ("svc", 3, 2, 0)
    assert identity.max_num_seqs(runner(vllm_config=config)) == 1  # max(1, ...), as vllm-omni counts rows
    assert identity.max_num_seqs(runner(max_num_reqs=5)) == 5


@pytest.mark.parametrize(("value", "expected"), [("2", 2), (" 0 ", 0), ("-1", None), ("x", None), (None, None)])
def test_omni_replica(value: str | None, expected: int | None) -> None:
    environ = {} if value is None else {"VLLM_OMNI_REPLICA_ID": value}
    assert identity.omni_replica(environ) == expected


def test_ranks_are_zero_for_single_rank_groups() -> None:
    assert identity.parallel_ranks(SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)) == (0, 0)


def test_device_info(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    assert identity.device_info(runner(device=torch.device("cpu"))) == DeviceInfo(kind="cpu")
    # No CUDA here: torch cannot tell the UUID, so it stays None; the index comes from CUDA_VISIBLE_DEVICES.
    assert identity.device_info(runner(device=torch.device("cuda", 1))) == DeviceInfo("cuda", 7, None)
    assert identity.device_info(runner()) == DeviceInfo(kind="unknown")


def test_pod_identity_comes_from_the_environment_the_deploy_manifests_set() -> None:
    environ = {
        identity.ENV_POD_NAME: "qwen3-tts-7f9c",
        identity.ENV_POD_NAMESPACE: " tts ",
        identity.ENV_CONTAINER_NAME: "",
    }
    assert identity.pod_info(environ) == PodInfo(name="qwen3-tts-7f9c", namespace="tts", container=None)
    assert identity.pod_info({}) == PodInfo()  # outside Kubernetes: unknown, never guessed
