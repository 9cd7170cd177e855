"""The stale-manifest rule (kv_exporter.sidecar.liveness) against real processes in this pid namespace."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from kv_exporter import procfs
from kv_exporter.manifest import Manifest, ProcessInfo, current_pid_namespace, process_start_ticks
from kv_exporter.procfs import ProcessWatch
from kv_exporter.reference import MIMO_AUDIO, QWEN3_TTS
from kv_exporter.sidecar.liveness import State, classify
from tests.support.manifests import reference_manifest

OURS = current_pid_namespace()


def with_process(manifest: Manifest, process: ProcessInfo, written_at: float | None = None) -> Manifest:
    return replace(manifest, process=process, written_at=written_at or manifest.written_at)


def dead_pid() -> tuple[int, int | None]:
    """The pid and start time of a process that we started and that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = process_start_ticks(child.pid)
    child.wait(10)
    return child.pid, ticks


def test_own_process_is_live() -> None:
    m = with_process(reference_manifest(QWEN3_TTS), ProcessInfo.current())
    verdict = classify([("a", m)], OURS)["a"]
    assert verdict.state is State.LIVE


def test_dead_process_is_stale() -> None:
    pid, ticks = dead_pid()
    m = with_process(reference_manifest(QWEN3_TTS), ProcessInfo(pid, ticks, OURS, "h"))
    assert classify([("a", m)], OURS)["a"].state is State.STALE


def test_reused_pid_is_stale() -> None:
    me = ProcessInfo.current()
    assert me.start_time_ticks is not None
    m = with_process(reference_manifest(QWEN3_TTS), replace(me, start_time_ticks=me.start_time_ticks - 1))
    verdict = classify([("a", m)], OURS)["a"]
    assert verdict.state is State.STALE
    assert "another process" in verdict.why


def test_verifiable_stale_is_stale_even_when_newest() -> None:
    pid, ticks = dead_pid()
    m = with_process(reference_manifest(QWEN3_TTS), ProcessInfo(pid, ticks, OURS, "h"), written_at=9e9)
    assert classify([("a", m)], OURS)["a"].state is State.STALE


def test_unverifiable_newest_incarnation_wins() -> None:
    base = reference_manifest(QWEN3_TTS)
    old_rank0 = with_process(base, ProcessInfo(10, 1, "pid:[7]", "pod"), 100.0)
    old_rank1 = replace(with_process(base, ProcessInfo(11, 1, "pid:[7]", "pod"), 101.0))
    old_rank1 = replace(old_rank1, engine=replace(old_rank1.engine, tp_rank=1))
    new_rank0 = with_process(base, ProcessInfo(10, 5, "pid:[8]", "pod"), 200.0)
    other_engine = with_process(reference_manifest(MIMO_AUDIO), ProcessInfo(12, 1, "pid:[7]", "pod"), 50.0)
    verdicts = classify([("o0", old_rank0), ("o1", old_rank1), ("n0", new_rank0), ("x", other_engine)], OURS)
    assert {k: v.state for k, v in verdicts.items()} == {
        "o0": State.STALE,
        "o1": State.STALE,  # a rank the restarted engine no longer has
        "n0": State.LIVE,
        "x": State.LIVE,  # another engine: its own newest
    }


def test_ranks_of_one_incarnation_are_all_live() -> None:
    base = reference_manifest(QWEN3_TTS)
    r0 = with_process(base, ProcessInfo(10, 1, "pid:[7]", "pod"), 100.0)
    rank1 = replace(base, engine=replace(base.engine, tp_rank=1))
    r1 = with_process(rank1, ProcessInfo(11, 1, "pid:[7]", "pod"))
    verdicts = classify([("r0", r0), ("r1", r1)], OURS)
    assert all(v.state is State.LIVE for v in verdicts.values())


def test_unknown_namespace_is_not_verifiable() -> None:
    pid, ticks = dead_pid()
    m = with_process(reference_manifest(QWEN3_TTS), ProcessInfo(pid, ticks, None, "h"))
    assert classify([("a", m)], OURS)["a"].state is State.LIVE  # only the newest rule applies
    assert classify([("a", m)], None)["a"].state is State.LIVE


def test_a_watched_process_is_read_from_proc_once_and_its_exit_seen_at_the_next_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[int] = []
    read = procfs.process_start_ticks

    def counted(pid: int, proc: str = "/proc") -> int | None:
        reads.append(pid)
        return read(pid, proc)

    monkeypatch.setattr(procfs, "process_start_ticks", counted)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        m = with_process(reference_manifest(QWEN3_TTS), ProcessInfo.current())
        theirs = with_process(m, replace(m.process, pid=child.pid, start_time_ticks=process_start_ticks(child.pid)))
        watch = ProcessWatch()
        for _ in range(3):
            verdicts = classify([("ours", m), ("theirs", theirs), ("again", theirs)], OURS, watch=watch)
            assert {v.state for v in verdicts.values()} == {State.LIVE}
        assert sorted(reads) == sorted([os.getpid(), child.pid])  # once each, not once a scrape or a manifest
        child.kill()  # not reaped yet: a zombie, which /proc still shows
        deadline = time.monotonic() + 5
        while classify([("theirs", theirs)], OURS, watch=watch)["theirs"].state is State.LIVE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert classify([("theirs", theirs)], OURS)["theirs"].state is State.LIVE  # /proc: the zombie is there
    finally:
        child.kill()
        child.wait(10)
    assert classify([("theirs", theirs)], OURS, watch=watch)["theirs"].state is State.STALE  # reaped
    watch.close()


def test_a_watch_holds_descriptors_only_for_the_processes_asked_about() -> None:
    fds = len(os.listdir("/proc/self/fd"))
    watch = ProcessWatch(most=2)
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        pids = [c.pid for c in children]
        ticks = watch.start_ticks(pids)
        assert ticks == {pid: process_start_ticks(pid) for pid in pids}  # the third from /proc: over `most`
        assert len(os.listdir("/proc/self/fd")) == fds + 2
        watch.start_ticks(pids[:1])
        assert len(os.listdir("/proc/self/fd")) == fds + 1
        watch.close()
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        for child in children:
            child.kill()
            child.wait(10)
