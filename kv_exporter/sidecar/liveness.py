"""The stale-manifest rule: which manifests describe a process that still exists.

A manifest from a dead or restarted engine must not inflate the projection. A clean exit removes the file and
a restarted worker overwrites its own file, so stale files come from hard kills (OOM, SIGKILL, node trouble)
and from engines that came back with fewer ranks. The rule:

1. Verifiable: the manifest's pid namespace is the sidecar's own (same pod with `shareProcessNamespace`, or
   both in the host namespace). Live iff /proc/<pid> exists and its start time (clock ticks since boot) equals
   the one recorded (a reused pid has a different start time). With no recorded start time, existence decides.
2. Not verifiable (another pid namespace, or either namespace unknown): group manifests by engine
   (model_name, stage, engine index) and by incarnation (hostname, pid namespace: a restarted container gets a
   new pid namespace). Only the incarnation that wrote the newest manifest of the engine is live; older
   incarnations' files are stale. An engine that died and never came back cannot be told from a live one here:
   its running count then falls back to 0 (engine_up 0), which keeps the projection an upper bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kv_exporter.manifest import Manifest
from kv_exporter.procfs import ProcessWatch, process_start_ticks


class State(str, Enum):
    LIVE = "live"
    STALE = "stale"
    INVALID = "invalid"


@dataclass(frozen=True)
class Verdict:
    state: State
    why: str  # a short human sentence, shown on the landing page and in logs


def _process_verdict(manifest: Manifest, ticks: int | None) -> Verdict:
    """`ticks`: the start time of the manifest's pid now (None: no such process)."""
    process = manifest.process
    if ticks is None:
        return Verdict(State.STALE, f"process {process.pid} is gone")
    if process.start_time_ticks is not None and ticks != process.start_time_ticks:
        return Verdict(State.STALE, f"pid {process.pid} now belongs to another process (start time differs)")
    return Verdict(State.LIVE, f"process {process.pid} is running")


def _engine_of(manifest: Manifest) -> tuple[str, int, int]:
    engine = manifest.engine
    return (engine.model_name, engine.stage, engine.engine_index)


def _incarnation(manifest: Manifest) -> tuple[str, str | None]:
    return (manifest.process.hostname, manifest.process.pid_namespace)


def verifiable(manifest: Manifest, our_namespace: str | None) -> bool:
    theirs = manifest.process.pid_namespace
    return our_namespace is not None and theirs is not None and theirs == our_namespace


def classify(
    manifests: Sequence[tuple[str, Manifest]],
    our_namespace: str | None,
    proc: str = "/proc",
    watch: ProcessWatch | None = None,
) -> dict[str, Verdict]:
    """Verdict per manifest path (every path given gets one). `watch`: the start times of the processes it watches
    come without reading /proc (a collection keeps one from scrape to scrape)."""
    verdicts: dict[str, Verdict] = {}
    unverifiable: list[tuple[str, Manifest]] = []
    checked: list[tuple[str, Manifest]] = []
    for path, manifest in manifests:
        (checked if verifiable(manifest, our_namespace) else unverifiable).append((path, manifest))
    pids = {manifest.process.pid for _, manifest in checked}
    now = watch.start_ticks(pids) if watch is not None else {pid: process_start_ticks(pid, proc) for pid in pids}
    for path, manifest in checked:
        verdicts[path] = _process_verdict(manifest, now[manifest.process.pid])
    newest: dict[tuple[str, int, int], Manifest] = {}
    for _, manifest in unverifiable:
        key = _engine_of(manifest)
        if key not in newest or manifest.written_at > newest[key].written_at:
            newest[key] = manifest
    for path, manifest in unverifiable:
        current = _incarnation(newest[_engine_of(manifest)])
        if _incarnation(manifest) == current:
            verdicts[path] = Verdict(State.LIVE, "newest incarnation of its engine (pid not checkable here)")
        else:
            verdicts[path] = Verdict(State.STALE, "superseded by a newer incarnation of its engine")
    return verdicts
