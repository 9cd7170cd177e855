"""A worker's step record written beside its manifest, as the hook's writer leaves it mid-step."""

from __future__ import annotations

from pathlib import Path

from kv_exporter.manifest import Manifest, manifest_filename
from kv_exporter.steprecord import RecordWriter, new_record, record_name


def write_step_record(folder: Path, manifest: Manifest, running: int, most: int | None = None) -> Path:
    """A record of `manifest`'s worker that ran a step of `most` sequences (default `running`) and runs one of
    `running` now: the sidecar reads it as stepping (for a minute; stalled after, with the same figures)."""
    data = bytearray(new_record(manifest.process.pid, manifest.process.start_time_ticks))
    writer = RecordWriter(data)
    writer.begin(running if most is None else most)
    writer.end()
    writer.begin(running)
    path = folder / record_name(manifest_filename(manifest.engine))
    path.write_bytes(bytes(data))
    return path
