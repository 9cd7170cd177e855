"""The step record (kv_exporter/steprecord.py) and the sidecar's reading of it (sidecar/running.py), torch-free: the
records here are written by `RecordWriter`, the protocol in Python (tests/torch/test_plugin_steps.py checks that the
hook's C writer writes the same bytes)."""

from __future__ import annotations

import json
import os
import random
import resource
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kv_exporter.manifest import Manifest, ProcessInfo, manifest_filename, write_manifest
from kv_exporter.reference import QWEN3_TTS
from kv_exporter.sidecar import running as running_module
from kv_exporter.sidecar.engine_page import EngineKey, scan_page
from kv_exporter.sidecar.liveness import State, Verdict
from kv_exporter.sidecar.records import GpuResult, ManifestEntry, PageResult
from kv_exporter.sidecar.report import run_report
from kv_exporter.sidecar.running import (
    ABSENT,
    MAX_OPEN,
    OTHER_DESCRIPTORS,
    RECENT_S,
    STALL_AFTER_S,
    Running,
    RunningState,
    StepRecords,
    engine_running,
    engines_running,
    judge,
    records_kept_open,
)
from kv_exporter.sidecar.snapshot import WORKERS, Snapshot, build_snapshot
from kv_exporter.steprecord import (
    BUCKET_NS,
    RECORD_BYTES,
    SEQ_OFFSET,
    RecordProblem,
    RecordWriter,
    StepRecord,
    decode,
    new_record,
    read_consistent,
    record_name,
)
from tests.support.manifests import reference_manifest
from tests.support.pages import vllm_page_with

S = 1_000_000_000
WINDOW = 15 * S
T0 = 1_000 * S  # a monotonic time well past zero


def written(*steps: tuple[int | None, int, int | None]) -> StepRecord:
    """A record after `steps`: (count, began, ended or None: still running), in ns."""
    data = bytearray(new_record(4242, 77))
    writer = RecordWriter(data)
    for count, began, ended in steps:
        writer.begin(count, began)
        if ended is not None:
            writer.end(ended)
    record = decode(bytes(data))
    assert isinstance(record, StepRecord)
    return record


# -- the record -------------------------------------------------------------------------------------------------


def test_a_new_record_has_run_nothing() -> None:
    record = decode(new_record(4242, 77))
    assert isinstance(record, StepRecord)
    assert (record.pid, record.start_time_ticks, record.steps, record.finished) == (4242, 77, 0, 0)
    assert len(new_record(1, None)) == RECORD_BYTES and record.most_in(T0 // BUCKET_NS, T0 // BUCKET_NS + 200) == 0


def test_steps_and_their_buckets() -> None:
    record = written((3, T0, T0 + S // 10), (8, T0 + 2 * S, T0 + 2 * S + 1), (5, T0 + 3 * S, None))
    assert (record.steps, record.finished, record.latest, record.in_step) == (3, 2, 5, True)
    assert record.latest_started_ns == T0 + 3 * S and record.latest_finished_ns == T0 + 2 * S + 1
    second = T0 // BUCKET_NS
    assert record.most_in(second, second + 3) == 8
    assert record.most_in(second + 3, second + 3) == 5  # only the step that began in that second
    assert record.most_in(second + 4, second + 10) == 0


def test_a_step_counts_in_the_second_it_ends_in_too() -> None:
    record = written((6, T0, T0 + 5 * S // 2))
    assert record.most_in(T0 // BUCKET_NS + 2, T0 // BUCKET_NS + 2) == 6


def test_a_bucket_is_reset_when_a_later_second_takes_its_slot() -> None:
    later = T0 + 128 * S  # the same slot, 128 s on
    record = written((7, T0, T0 + 1), (2, later, later + 1))
    assert record.most_in(T0 // BUCKET_NS, T0 // BUCKET_NS + 128) == 2


def test_an_unreadable_count_is_counted_and_known_as_such() -> None:
    record = written((4, T0, T0 + 1), (None, T0 + S, None))
    assert record.latest is None and record.unreadable == 1 and record.most_in(T0 // BUCKET_NS, T0 // BUCKET_NS) == 4


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:-1],
        lambda b: b + b"\0",
        lambda b: b"XXXXXXXX" + b[8:],
        lambda b: b[:8] + (2).to_bytes(4, "little") + b[12:],
        lambda b: b[:24] + (5).to_bytes(8, "little") + b[32:],  # another bucket size
        lambda b: b[:64] + (9).to_bytes(8, "little") + b[72:],  # more steps ended than began
    ],
    ids=["short", "long", "magic", "version", "bucket_ns", "finished>steps"],
)
def test_anything_but_a_version_1_record_is_invalid(damage: object) -> None:
    assert decode(damage(new_record(1, 1))) is RecordProblem.INVALID  # type: ignore[operator]


def test_a_write_in_progress_is_torn_and_two_differing_copies_are_read_again() -> None:
    data = bytearray(new_record(1, 1))
    data[SEQ_OFFSET] = 1  # odd: a write began and never ended
    assert read_consistent(lambda: bytes(data)) is RecordProblem.TORN
    copies = iter([b"a" * RECORD_BYTES, b"b" * RECORD_BYTES, new_record(1, 1), new_record(1, 1)])
    assert isinstance(read_consistent(lambda: next(copies)), StepRecord)


def test_a_reader_never_takes_a_copy_mixed_from_two_steps() -> None:
    """A writer thread steps as fast as it can (the GIL switches between its fields' writes); every consistent copy
    must be a state the writer really left between two writes: the latest count is the step number's, and the
    latest step has ended or is the one running."""
    data = bytearray(new_record(1, 1))
    writer, stop = RecordWriter(data), threading.Event()

    def steps() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            writer.begin(n % 50, T0)  # one bucket: its most only grows until n % 50 wraps
            writer.end(T0)

    thread = threading.Thread(target=steps)
    thread.start()
    try:
        seen = 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            record = read_consistent(lambda: bytes(data))
            if isinstance(record, StepRecord) and record.steps:
                assert record.latest == record.steps % 50 and record.finished in (record.steps - 1, record.steps)
                seen += 1
    finally:
        stop.set()
        thread.join()
    assert seen > 10


def test_the_record_is_named_after_its_manifest() -> None:
    assert record_name("m-1234.stage0.engine0.dp0.tp0.pp0.json") == "m-1234.stage0.engine0.dp0.tp0.pp0.steps"


# -- judging it at the scrape -----------------------------------------------------------------------------------


def window_most(record: StepRecord, now_ns: int, window_ns: int) -> int:
    """The reference: the most any step ran in the seconds the window reaches, read whole from the record."""
    return record.most_in((now_ns - window_ns) // BUCKET_NS, now_ns // BUCKET_NS)


def judged(record: StepRecord, now: int, max_num_seqs: int) -> Running:
    return judge(record, now, window_most(record, now, WINDOW), max_num_seqs)


def test_a_running_step_runs_its_sequences() -> None:
    record = written((8, T0, T0 + S), (5, T0 + 2 * S, None))
    assert judged(record, T0 + 3 * S, 8) == Running(RunningState.STEPPING, 5, 8)


def test_a_step_that_ended_within_a_second_still_runs_and_then_nothing_does() -> None:
    record = written((6, T0, T0 + S))
    assert judged(record, T0 + S + int(RECENT_S * S), 8) == Running(RunningState.STEPPING, 6, 6)
    assert judged(record, T0 + S + int(RECENT_S * S) + 1, 8) == Running(RunningState.IDLE, 0, 6)
    assert judged(record, T0 + 20 * S, 8) == Running(RunningState.IDLE, 0, 0)  # the window has passed


def test_the_window_s_most_kept_between_reads_is_the_whole_window_s() -> None:
    """A reader keeps the settled seconds between reads (`_Buckets`): at every read, what it gives is what reading
    every bucket of the window gives."""
    rng = random.Random(7)
    data = bytearray(new_record(1, 1))
    writer, kept = RecordWriter(data), running_module._Buckets()
    now = T0  # the writer's (coarse) clock; the reader's runs ahead of it by up to a tick (SETTLE_NS allows 50 ms)
    for _ in range(3000):
        now += rng.choice((1_000_000, 20_000_000, 400_000_000, 3 * S))
        if rng.random() < 0.7:
            writer.begin(rng.randrange(65), now)
            now += rng.randrange(5_000_000)
            writer.end(now)
        record = decode(bytes(data))
        assert isinstance(record, StepRecord)
        read_at = now + rng.randrange(4_000_000)
        assert kept.most(record, read_at, WINDOW) == window_most(record, read_at, WINDOW)
        now = max(now, read_at - 4_000_000)


def test_a_worker_that_never_stepped_is_idle() -> None:
    assert judged(written(), T0, 8) == Running(RunningState.IDLE, 0, 0)


def test_one_step_running_for_a_minute_is_stalled_and_still_holds_its_sequences() -> None:
    record = written((4, T0, None))
    assert judged(record, T0 + int(STALL_AFTER_S * S) - 1, 8).state is RunningState.STEPPING
    assert judged(record, T0 + int(STALL_AFTER_S * S), 8) == Running(RunningState.STALLED, 4, 4)


def test_counts_above_max_num_seqs_are_refused() -> None:
    assert judged(written((9, T0, None)), T0, 8) == Running(RunningState.INVALID)
    assert judged(written((9, T0, T0), (2, T0 + S, None)), T0 + S, 8) == Running(RunningState.INVALID)


def test_an_unreadable_latest_step_gives_no_count_but_the_window_s_most() -> None:
    record = written((4, T0, T0 + 1), (None, T0 + S, None))
    assert judged(record, T0 + S, 8) == Running(RunningState.UNREADABLE, None, 4)


def test_an_engine_is_the_most_of_its_workers_in_the_worst_state() -> None:
    workers = [
        Running(RunningState.STEPPING, 3, 8),
        Running(RunningState.STALLED, 5, 5),
        Running(RunningState.IDLE, 0, 2),
    ]
    assert engine_running(workers) == Running(RunningState.STALLED, 5, 8)
    assert engine_running([Running(RunningState.TORN), Running(RunningState.IDLE, 0, 0)]) == Running(
        RunningState.TORN, 0, 0
    )


# -- reading the files ------------------------------------------------------------------------------------------


def live(path: Path, manifest: Manifest) -> ManifestEntry:
    return ManifestEntry(str(path), manifest, Verdict(State.LIVE, "test"))


def worker(folder: Path, **changes: object) -> tuple[ManifestEntry, Path]:
    manifest = replace(reference_manifest(QWEN3_TTS, max_num_seqs=8), process=ProcessInfo.current(), **changes)
    path = write_manifest(folder, manifest)
    return live(path, manifest), folder / record_name(path.name)


def record_file(path: Path, process: ProcessInfo, *steps: tuple[int, bool]) -> None:
    """A record at `path` after `steps`: (count, still running), taken now."""
    data = bytearray(new_record(process.pid, process.start_time_ticks))
    writer = RecordWriter(data)
    for count, running in steps:
        writer.begin(count)
        if not running:
            writer.end()
    path.write_bytes(bytes(data))


def test_each_live_worker_is_read_from_its_own_record(tmp_path: Path) -> None:
    entry, path = worker(tmp_path)
    record_file(path, entry.manifest.process, (8, False), (3, True))  # type: ignore[union-attr]
    records = StepRecords()
    try:
        assert records.read([entry]) == {entry.path: Running(RunningState.STEPPING, 3, 8)}
        record_file(path, entry.manifest.process, (2, False))  # type: ignore[union-attr]  # written in place: same file
        assert records.read([entry])[entry.path] == Running(RunningState.STEPPING, 2, 2)
    finally:
        records.close()


def test_no_record_or_another_process_s_is_absent_and_looked_for_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(running_module, "RETRY_S", 0.0)
    entry, path = worker(tmp_path)
    records = StepRecords()
    try:
        assert records.read([entry])[entry.path] is ABSENT
        other = ProcessInfo(pid=1, start_time_ticks=1)
        record_file(path, other, (4, True))  # an earlier worker's
        assert records.read([entry])[entry.path] is ABSENT
        record_file(path, entry.manifest.process, (4, True))  # type: ignore[union-attr]  # this one's, at last
        assert records.read([entry])[entry.path] == Running(RunningState.STEPPING, 4, 4)
    finally:
        records.close()


def test_a_missing_record_is_not_looked_for_on_every_scrape(tmp_path: Path) -> None:
    entry, path = worker(tmp_path)
    records = StepRecords()
    try:
        assert records.read([entry])[entry.path] is ABSENT
        record_file(path, entry.manifest.process, (4, True))  # type: ignore[union-attr]
        assert records.read([entry])[entry.path] is ABSENT  # within RETRY_S of the last look
    finally:
        records.close()


@pytest.mark.parametrize("content", [b"", b"\0" * RECORD_BYTES, b"short"], ids=["empty", "zeros", "short"])
def test_a_damaged_record_costs_its_worker_s_figures(tmp_path: Path, content: bytes) -> None:
    entry, path = worker(tmp_path)
    path.write_bytes(content)
    records = StepRecords()
    try:
        assert records.read([entry])[entry.path] == Running(RunningState.INVALID)
    finally:
        records.close()


def test_a_record_truncated_under_the_reader_is_invalid_not_a_crash(tmp_path: Path) -> None:
    entry, path = worker(tmp_path)
    record_file(path, entry.manifest.process, (4, True))  # type: ignore[union-attr]
    records = StepRecords()
    try:
        assert records.read([entry])[entry.path].state is RunningState.STEPPING
        os.truncate(path, 100)
        assert records.read([entry])[entry.path] == Running(RunningState.INVALID)
    finally:
        records.close()


def test_a_fifo_in_the_record_s_place_does_not_block(tmp_path: Path) -> None:
    entry, path = worker(tmp_path)
    os.mkfifo(path)
    records = StepRecords()
    try:
        assert records.read([entry])[entry.path] == Running(RunningState.INVALID)
    finally:
        records.close()


def test_a_write_left_unfinished_is_torn_once_it_has_lasted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, path = worker(tmp_path)
    record_file(path, entry.manifest.process, (4, True))  # type: ignore[union-attr]
    records = StepRecords()
    try:
        good = records.read([entry])[entry.path]
        data = bytearray(path.read_bytes())
        data[SEQ_OFFSET] |= 1
        path.write_bytes(bytes(data))
        assert records.read([entry])[entry.path] == good  # a writer descheduled mid-write: the last good copy
        monkeypatch.setattr(running_module, "_TORN_NS", 0)
        assert records.read([entry])[entry.path] == Running(RunningState.TORN)
    finally:
        records.close()


def test_records_of_manifests_no_longer_live_are_let_go(tmp_path: Path) -> None:
    entry, path = worker(tmp_path)
    record_file(path, entry.manifest.process, (4, True))  # type: ignore[union-attr]
    records = StepRecords()
    try:
        records.read([entry])
        assert records._open
        assert records.read([replace(entry, verdict=Verdict(State.STALE, "gone"))]) == {}
        assert not records._open
    finally:
        records.close()


def test_engines_with_and_without_records(tmp_path: Path) -> None:
    a, _ = worker(tmp_path)
    b, _ = worker(tmp_path, engine=replace(a.manifest.engine, tp_rank=1))  # type: ignore[union-attr]
    key = EngineKey("Qwen3-TTS", 0, 0)
    mixed = {a.path: Running(RunningState.STEPPING, 3, 4), b.path: ABSENT}
    assert engines_running([a, b], mixed) == {key: Running(RunningState.STEPPING, 3, 4)}
    assert engines_running([a, b], {a.path: ABSENT, b.path: ABSENT}) == {key: ABSENT}


# -- in the snapshot --------------------------------------------------------------------------------------------


def snapshot_with(workers: dict[EngineKey, Running], page_running: int) -> Snapshot:
    manifest = reference_manifest(QWEN3_TTS, max_num_seqs=8)
    entry = ManifestEntry(manifest_filename(manifest.engine), manifest, Verdict(State.LIVE, "test"))
    pages = [PageResult("http://e/metrics", scan_page(vllm_page_with(page_running, "Qwen3-TTS")), None, 0.0)]
    return build_snapshot([entry], pages, GpuResult(enabled=False, source=None), workers=workers)


KEY = EngineKey("Qwen3-TTS", 0, 0)


def test_the_workers_count_is_used_and_the_page_only_compared() -> None:
    snap = snapshot_with({KEY: Running(RunningState.STEPPING, 3, 7)}, page_running=5)
    [engine] = snap.engines
    assert (engine.running, engine.most, engine.target, engine.page_difference) == (3, 7, WORKERS, 2)
    scaling = [v for v in snap.declarations if v.placed.scales]
    assert scaling and all(v.running == 3 and v.estimate_rows == 3 for v in scaling)
    assert all(v.peak_bytes == v.declaration.bytes_per_row * 7 for v in scaling)


def test_an_engine_without_records_is_read_from_its_page() -> None:
    snap = snapshot_with({KEY: ABSENT}, page_running=5)
    [engine] = snap.engines
    assert (engine.running, engine.most, engine.state, engine.page_difference) == (5, None, RunningState.ABSENT, None)
    assert all(v.peak_bytes is None for v in snap.declarations)


def test_a_record_that_cannot_say_is_never_replaced_by_the_page() -> None:
    snap = snapshot_with({KEY: Running(RunningState.TORN)}, page_running=5)
    [engine] = snap.engines
    assert (engine.running, engine.up, engine.state) == (None, False, RunningState.TORN)
    scaling = [v for v in snap.declarations if v.placed.scales]
    assert all(v.estimate_rows == 0 for v in scaling)  # the projection's upper bound, as for an unreadable page


def test_the_report_shows_what_each_worker_runs(tmp_path: Path) -> None:
    entry, path = worker(tmp_path)
    record_file(path, entry.manifest.process, (7, False), (3, True))  # type: ignore[union-attr]
    text, status = run_report(str(tmp_path), None, False)
    assert status == 0 and "running: 3 now, most 7 over the last 15 s (stepping)" in text, text
    document, _ = run_report(str(tmp_path), None, True)
    [reported] = json.loads(document)["manifests"]
    assert reported["running"] == {"state": "stepping", "now": 3, "most": 7, "window_s": 15.0}


def test_records_past_those_kept_open_are_read_through_a_descriptor_opened_each_time(tmp_path: Path) -> None:
    workers = [worker(tmp_path, engine=replace(reference_manifest(QWEN3_TTS).engine, tp_rank=rank)) for rank in (0, 1)]
    for count, (entry, path) in enumerate(workers, 3):
        record_file(path, entry.manifest.process, (count, True))  # type: ignore[union-attr]
    records = StepRecords(kept_open=1)
    try:
        for _ in range(2):
            assert [records.read([entry for entry, _ in workers])[e.path].latest for e, _ in workers] == [3, 4]
            assert [found.fd is not None for found in records._open.values()] == [True, False]
    finally:
        records.close()


def test_as_many_records_are_kept_open_as_the_descriptor_limit_leaves() -> None:
    assert records_kept_open(1024) == MAX_OPEN  # the usual default soft limit: at the least
    assert records_kept_open(20_000) == 20_000 - OTHER_DESCRIPTORS
    assert records_kept_open(resource.RLIM_INFINITY) >= 1 << 20
