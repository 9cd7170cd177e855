"""The high-water between two samples, bounded from torch's allocator counters without resetting its peak
(plugin/observe/cuda.py). The readings are what `torch.cuda.memory_stats` gives for the sequences named; the GPU proof
(`make gpu-proof`) checks the same bounds against a real CUDA allocator."""

from __future__ import annotations

from kv_exporter.plugin.observe.cuda import _Reading, high_water_bounds

MIB = 1 << 20


def test_the_first_sample_gives_the_peak_since_the_allocators_reset() -> None:
    assert high_water_bounds(None, _Reading(allocated=3 * MIB, peak=9 * MIB, allocated_ever=40 * MIB)) == (
        9 * MIB,
        9 * MIB,
    )


def test_a_peak_that_rose_in_between_is_the_high_water_exactly() -> None:
    before = _Reading(allocated=3 * MIB, peak=9 * MIB, allocated_ever=40 * MIB)
    after = _Reading(allocated=4 * MIB, peak=12 * MIB, allocated_ever=60 * MIB)  # 12 MiB at some instant between
    assert high_water_bounds(before, after) == (12 * MIB, 12 * MIB)


def test_an_unchanged_peak_is_bounded_by_what_was_allocated_in_between() -> None:
    before = _Reading(allocated=3 * MIB, peak=9 * MIB, allocated_ever=40 * MIB)
    # 2 MiB allocated (and 1 freed): at most 3 + 2 was held; at least the larger of the two samples.
    after = _Reading(allocated=4 * MIB, peak=9 * MIB, allocated_ever=42 * MIB)
    assert high_water_bounds(before, after) == (4 * MIB, 5 * MIB)
    # Nothing allocated at all: exact.
    assert high_water_bounds(after, after) == (4 * MIB, 4 * MIB)
    # Much allocated and freed: the unchanged peak is the tighter bound.
    busy = _Reading(allocated=4 * MIB, peak=9 * MIB, allocated_ever=400 * MIB)
    assert high_water_bounds(after, busy) == (4 * MIB, 9 * MIB)


def test_a_reset_in_between_keeps_both_sides_of_it() -> None:
    before = _Reading(allocated=3 * MIB, peak=9 * MIB, allocated_ever=40 * MIB)
    # vLLM's profiler reset the peak; 5 MiB was reached after the reset; 1 MiB allocated before it at most.
    after = _Reading(allocated=2 * MIB, peak=5 * MIB, allocated_ever=46 * MIB)
    assert high_water_bounds(before, after) == (5 * MIB, 9 * MIB)
    quiet = _Reading(allocated=2 * MIB, peak=2 * MIB, allocated_ever=40 * MIB)
    assert high_water_bounds(before, quiet) == (3 * MIB, 3 * MIB)


def test_cumulative_counters_reset_in_between_leave_the_peak_as_the_bound() -> None:
    before = _Reading(allocated=3 * MIB, peak=9 * MIB, allocated_ever=40 * MIB)
    after = _Reading(allocated=3 * MIB, peak=9 * MIB, allocated_ever=1 * MIB)  # reset_accumulated_memory_stats
    assert high_water_bounds(before, after) == (3 * MIB, 9 * MIB)
