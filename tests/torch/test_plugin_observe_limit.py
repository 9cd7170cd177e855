"""The allocator's per-process cap in the worker's observation (plugin/observe/cuda.py), beside its figures.

The CUDA allocator is the boundary faked here (tests/support/fake_cuda.py: torch.cuda's calls, names and error
classes), exactly as narrowly as NVML is; the model and its caches are real. `make gpu-proof` shows the same on a GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DynamicCache, Qwen2ForCausalLM

from kv_exporter.observation import AllocatorLimitAbsent, CudaUnavailable, Observation
from kv_exporter.plugin import observe
from kv_exporter.plugin.observe.cuda import CudaAllocator, cap_bytes
from tests.support.cache_models import build, full_config, prefill_and_decode
from tests.support.fake_cuda import FakeCuda
from tests.support.observing import observer, sample, warnings_logged

__all__ = ["observer"]  # the fixture, imported for pytest

GIB = 1 << 30
MIB = 1 << 20
TOTAL = 80 * GIB


def observed_with(fake: object) -> Observation:
    """A sample of a worker on cuda:0 whose allocator is `fake`, holding one real cache."""
    observe._observer.cuda = CudaAllocator(fake)  # type: ignore[arg-type]  # the stand-in answers the same calls
    model = build(Qwen2ForCausalLM, full_config(), torch.float32)
    prefill_and_decode(model, DynamicCache(), batch=1, prompt_len=5, decode_steps=1)
    observe.attach(model, [], torch.device("cuda", 0))
    return sample()


@pytest.mark.usefixtures("observer")
def test_a_capped_allocator_reports_its_limit_in_bytes() -> None:
    fake = FakeCuda(total=TOTAL, allocated=20 * GIB, reserved=21 * GIB, peak=22 * GIB)
    fake.set_per_process_memory_fraction(0.3)
    cuda = observed_with(fake).cuda
    assert cuda is not None and cuda.limit_absent is None
    assert cuda.limit_bytes == cap_bytes(0.3, TOTAL) == int(0.3 * TOTAL)
    assert (cuda.allocated_bytes, cuda.reserved_bytes) == (20 * GIB, 21 * GIB)


@pytest.mark.usefixtures("observer")
def test_without_a_cap_the_figures_say_so() -> None:
    cuda = observed_with(FakeCuda(total=TOTAL, reserved=GIB)).cuda
    assert cuda is not None and (cuda.limit_bytes, cuda.limit_absent) == (None, AllocatorLimitAbsent.NO_CAP)
    fake = FakeCuda(total=TOTAL)
    fake.set_per_process_memory_fraction(1.0)  # the whole device allowed: no cap below the device's own
    cuda = observed_with(fake).cuda
    assert cuda is not None and cuda.limit_absent is AllocatorLimitAbsent.NO_CAP


class OldTorch:
    """A torch without get_per_process_memory_fraction: only the calls older releases had."""

    def __init__(self, fake: FakeCuda) -> None:
        self.is_initialized = fake.is_initialized
        self.memory_stats = fake.memory_stats
        self.mem_get_info = fake.mem_get_info


@pytest.mark.usefixtures("observer")
def test_a_torch_without_the_call_is_unsupported() -> None:
    cuda = observed_with(OldTorch(FakeCuda(total=TOTAL))).cuda
    assert cuda is not None and cuda.limit_absent is AllocatorLimitAbsent.UNSUPPORTED


class BrokenFraction(FakeCuda):
    def get_per_process_memory_fraction(self, device: object = None) -> float:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")  # torch's class for CUDA errors


@pytest.mark.usefixtures("observer")
def test_a_cap_that_cannot_be_read_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    first = observed_with(BrokenFraction(total=TOTAL)).cuda
    second = sample().cuda
    assert first is not None and second is not None
    assert first.limit_absent is second.limit_absent is AllocatorLimitAbsent.READ_FAILED
    assert first.reserved_bytes == 0  # the figures themselves still come
    assert warnings_logged(caplog, "cannot report its memory cap") == 1


@pytest.mark.usefixtures("observer")
def test_a_cpu_only_torch_has_no_figures_and_no_cap() -> None:
    observation = observed_with(FakeCuda(total=TOTAL, compiled=False))
    assert (observation.cuda, observation.cuda_unavailable) == (None, CudaUnavailable.NOT_INITIALISED)


@pytest.mark.usefixtures("observer")
def test_limit_minus_reserved_predicts_the_reservation_that_fails() -> None:
    """Grow in 48 MiB reservations under a 10 GiB cap with 80 GiB on the device: the figures of the last sample
    before the failure say how many more fit, to the reservation, while the device still has most of its memory."""
    fake = FakeCuda(total=TOTAL, reserved=7 * GIB, allocated=7 * GIB)
    fake.set_per_process_memory_fraction(10 * GIB / TOTAL)
    step = 48 * MIB
    cuda = observed_with(fake).cuda
    assert cuda is not None and cuda.limit_bytes is not None
    predicted = (cuda.limit_bytes - cuda.reserved_bytes) // step
    done = 0
    with pytest.raises(torch.OutOfMemoryError):
        while True:
            fake.reserve(step)
            done += 1
    assert done == predicted
    assert fake.mem_get_info()[0] > 60 * GIB  # "free" on the device all along
    after = sample().cuda
    assert after is not None and after.ooms == 1
