"""`kv-exporter report`: the declarations in a manifest folder, and what the caches really hold beside them, as a
terminal table or JSON; no server.

For capacity planning: each manifest's declarations at its own max_num_seqs, or at `--max-num-seqs N`; what its
worker runs now and the most it ran over the last `running.DEFAULT_WINDOW_S` seconds (its step record, read as the
sidecar reads it); per owner, its declared ceiling beside the bytes its worker last observed (the sidecar's own
arithmetic, `observed.observe`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kv_exporter.manifest import Declaration, Manifest, ManifestError
from kv_exporter.printable import printable
from kv_exporter.procfs import current_pid_namespace
from kv_exporter.sidecar.inputs import ManifestStore, assess
from kv_exporter.sidecar.observed import ObservedState, OwnerView, observe, worker_state
from kv_exporter.sidecar.records import GpuResult, ManifestEntry
from kv_exporter.sidecar.running import ABSENT, DEFAULT_WINDOW_S, Running, StepRecords
from kv_exporter.sidecar.units import human_bytes


@dataclass(frozen=True)
class ReportRow:
    owner: str
    cache: str
    scope: str
    driver: str
    rows: int
    per_row: int

    @property
    def total(self) -> int:
        return self.rows * self.per_row


def manifest_rows(manifest: Manifest, max_num_seqs: int | None) -> list[ReportRow]:
    seqs = manifest.max_num_seqs if max_num_seqs is None else max_num_seqs
    return [_row(d, seqs) for d in manifest.declarations]


def _row(d: Declaration, seqs: int) -> ReportRow:
    return ReportRow(d.owner, d.name, d.scope.value, d.rows.value, d.row_count(seqs), d.bytes_per_row)


def _title(entry: ManifestEntry, manifest: Manifest, seqs: int) -> str:
    e = manifest.engine
    gpu = "?" if manifest.device.index is None else str(manifest.device.index)
    uuid = f" {manifest.device.uuid}" if manifest.device.uuid else ""
    return (
        f"{e.model_name}  stage {e.stage} engine {e.engine_index} (dp{e.data_parallel_rank} tp{e.tp_rank} "
        f"pp{e.pp_rank})  GPU {gpu}{uuid}  max_num_seqs {seqs}  [{entry.verdict.state.value}]"
    )


_HEADERS = ("owner", "cache", "scope", "driver", "rows", "per row", "total")
_OBSERVED_HEADERS = ("owner", "declared ceiling", "observed", "peak", "unexplained", "caches")


def _table(rows: Sequence[ReportRow]) -> list[str]:
    cells = [
        (r.owner or "(root)", r.cache, r.scope, r.driver, str(r.rows), human_bytes(r.per_row), human_bytes(r.total))
        for r in rows
    ]
    cells.append(("", "", "", "", "", "total", human_bytes(sum(r.total for r in rows))))
    return _aligned(_HEADERS, cells, numeric={4, 5, 6})


def _aligned(headers: Sequence[str], cells: Sequence[Sequence[str]], numeric: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in [headers, *cells]) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [
            cell.rjust(w) if i in numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(row) for row in cells)]


@dataclass(frozen=True)
class ObservedReport:
    state: ObservedState
    detail: str  # the worker's reason, or why its observation was refused
    age_s: float | None
    owners: tuple[OwnerView, ...]


def observed_report(entry: ManifestEntry, max_num_seqs: int | None, now: float) -> ObservedReport:
    """One worker's observation beside its declarations (at `--max-num-seqs` when given)."""
    assert entry.manifest is not None
    m = entry.manifest if max_num_seqs is None else replace(entry.manifest, max_num_seqs=max_num_seqs)
    state = worker_state(m, now)
    problem = m.observation_problem
    detail = f"{problem.reason}: {problem.detail}" if problem else (m.observation.reason if m.observation else "")
    owners = observe([replace(entry, manifest=m)], {}, GpuResult(enabled=False, source=None), now).owners
    age = now - m.observation.taken_at if m.observation and state is ObservedState.OK else None
    return ObservedReport(state, detail, age, owners)


def _observed_lines(report: ObservedReport, live: bool) -> list[str]:
    age = f", sampled {report.age_s:.1f} s ago" if report.age_s is not None else ""
    why = f": {report.detail}" if report.detail else ""
    head = f"observation: {report.state.value}{age}{why}" + ("" if live else " (not used: the manifest is not live)")
    cells = [
        (o.owner or "(root)", human_bytes(o.ceiling_bytes) if o.declares else "-", human_bytes(o.observed_bytes),
         human_bytes(o.peak_bytes) if o.peak_followed else "not followed", human_bytes(o.unexplained_bytes),
         str(o.caches))
        for o in report.owners
    ]  # fmt: skip
    return [head, *(_aligned(_OBSERVED_HEADERS, cells, numeric={1, 2, 3, 4, 5}) if cells else [])]


# The file `kv-exporter demo` writes on purpose, to show how an invalid manifest is reported (sidecar/demo.py).
DEMO_BROKEN_MANIFEST = "broken-example.json"
DEMO_BROKEN_NOTE = (
    f"note: {DEMO_BROKEN_MANIFEST} is the demo's deliberately broken manifest; like any invalid manifest it makes "
    "this report exit 1, as expected here"
)


def _running_line(running: Running) -> str:
    if running is ABSENT:
        return "running: no step record (an older hook, or a worker that is not live)"
    now = "?" if running.latest is None else str(running.latest)
    most = "?" if running.most is None else str(running.most)
    return f"running: {now} now, most {most} over the last {DEFAULT_WINDOW_S:g} s ({running.state.value})"


Workers = dict[str, Running]  # each live manifest's worker, by path (StepRecords.read)


def render_text(
    entries: Sequence[ManifestEntry], max_num_seqs: int | None, folder: str, now: float, workers: Workers
) -> str:
    out: list[str] = []
    grand = 0
    valid = [e for e in entries if e.manifest is not None]
    for entry in valid:
        assert entry.manifest is not None
        seqs = entry.manifest.max_num_seqs if max_num_seqs is None else max_num_seqs
        rows = manifest_rows(entry.manifest, max_num_seqs)
        grand += sum(r.total for r in rows)
        observed = _observed_lines(observed_report(entry, max_num_seqs, now), entry.live)
        running = _running_line(workers.get(entry.path, ABSENT))
        out += [_title(entry, entry.manifest, seqs), *_table(rows), running, *observed, ""]
    invalid = [e for e in entries if e.manifest is None]
    for entry in invalid:
        out.append(f"invalid: {entry.error}")
    if any(os.path.basename(e.path) == DEMO_BROKEN_MANIFEST for e in invalid):
        out.append(DEMO_BROKEN_NOTE)
    if not entries:
        out.append(f"no manifests in {printable(folder)}")
    total_line = f"all {len(valid)} manifest(s): {human_bytes(grand)} ({grand} B)"
    return "\n".join([*out, total_line]) + "\n"


def render_json(
    entries: Sequence[ManifestEntry], max_num_seqs: int | None, folder: str, now: float, workers: Workers
) -> str:
    manifests: list[dict[str, Any]] = []
    for entry in entries:
        if entry.manifest is None:
            continue
        m = entry.manifest
        rows = manifest_rows(m, max_num_seqs)
        manifests.append(
            {
                "path": printable(entry.path),
                "state": entry.verdict.state.value,
                "engine": {
                    "model_name": m.engine.model_name,
                    "stage": m.engine.stage,
                    "engine_index": m.engine.engine_index,
                    "data_parallel_rank": m.engine.data_parallel_rank,
                    "tp_rank": m.engine.tp_rank,
                    "pp_rank": m.engine.pp_rank,
                },
                "gpu": {"index": m.device.index, "uuid": m.device.uuid},
                "max_num_seqs": m.max_num_seqs if max_num_seqs is None else max_num_seqs,
                "declarations": [
                    {
                        "owner": r.owner,
                        "cache": r.cache,
                        "scope": r.scope,
                        "driver": r.driver,
                        "rows": r.rows,
                        "bytes_per_row": r.per_row,
                        "total_bytes": r.total,
                    }
                    for r in rows
                ],
                "total_bytes": sum(r.total for r in rows),
                "running": _running_json(workers.get(entry.path, ABSENT)),
                "observation": _observed_json(observed_report(entry, max_num_seqs, now)),
            }
        )
    invalid = [_invalid(e.path, e.error) for e in entries if e.error is not None]
    document = {
        "manifest_dir": printable(folder),
        "max_num_seqs": max_num_seqs,
        "manifests": manifests,
        "invalid": invalid,
        "total_bytes": sum(m["total_bytes"] for m in manifests),
    }
    return json.dumps(document, indent=2) + "\n"


def _observed_json(report: ObservedReport) -> dict[str, Any]:
    return {
        "state": report.state.value,
        "detail": report.detail,
        "age_s": report.age_s,
        "owners": [
            {
                "owner": o.owner,
                "declared_ceiling_bytes": o.ceiling_bytes if o.declares else None,
                "observed_bytes": o.observed_bytes,
                "peak_bytes": o.peak_bytes if o.peak_followed else None,
                "unexplained_bytes": o.unexplained_bytes,
                "caches": o.caches,
            }
            for o in report.owners
        ],
    }


def _running_json(running: Running) -> dict[str, Any]:
    return {"state": running.state.value, "now": running.latest, "most": running.most, "window_s": DEFAULT_WINDOW_S}


def _invalid(path: str, error: ManifestError) -> dict[str, str]:
    return {"path": printable(path), "reason": error.reason, "detail": error.detail}


def run_report(folder: str, max_num_seqs: int | None, as_json: bool) -> tuple[str, int]:
    """The report and the exit status: 0; 1 when a manifest is invalid; 2 when the folder is unreadable."""
    store = ManifestStore(folder)
    entries = assess(store.load(), current_pid_namespace())
    if store.folder_error is not None:
        return f"cannot read manifest folder {printable(folder)}: {store.folder_error}\n", 2
    records = StepRecords()
    workers = records.read(entries)
    records.close()
    render = render_json if as_json else render_text
    text = render(entries, max_num_seqs, folder, time.time(), workers)
    return text, 1 if any(e.manifest is None for e in entries) else 0
