"""The step record on the worker's side: made beside the manifest, and the runner's `execute_model` wrapped on the
instance, so that every step it runs writes its sequences (kv_exporter/steprecord.py; the writer is `_steps.c`).

Per instance, not per class: the instance attribute shadows the class's method, so the outermost call of a step
(`worker.model_runner.execute_model(...)`, as vLLM's V1 and Model Runner V2 workers and vllm-omni's make it) is
recorded once, and a subclass's `super().execute_model(...)` inside it is not recorded again; runners without a
record (another process, the hook off) run untouched. Never raises into vLLM: a record that cannot be made costs the
record, with one warning, and the model runs as before.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from pathlib import Path
from typing import Any

from kv_exporter.manifest import ProcessInfo
from kv_exporter.plugin.oncelog import warn_once
from kv_exporter.steprecord import RECORD_BYTES, RecordProblem, decode, new_record, record_name

METHOD = "execute_model"

try:
    from kv_exporter.plugin._steps import Record, StepWrapper
except ImportError:  # installed without a C compiler: no record (the sidecar falls back to the engine's page)
    Record = StepWrapper = None  # type: ignore[assignment, misc]


class _Records:
    """This process's open records (their mappings stay open until the process ends or forks)."""

    def __init__(self) -> None:
        self.open: dict[Path, Any] = {}  # path -> Record
        self.fork_handler = False

    def close_all(self) -> None:
        """In a forked child: its copies of the mappings are the parent's records, which only the parent writes."""
        for record in self.open.values():
            record.close()
        self.open.clear()


_records = _Records()


def attach(runner: Any, manifest_path: Path, process: ProcessInfo) -> Path | None:
    """Record `runner`'s steps beside the manifest at `manifest_path`; the record's path, or None. Idempotent."""
    if StepWrapper is None:
        warn_once("steps:not-built", "kv-exporter: the step record's writer is not built; no step record")
        return None
    current = getattr(runner, METHOD, None)
    if current is None:  # not a model runner (nothing steps through it): nothing to record
        return None
    if isinstance(current, StepWrapper):  # the warm-up manifest, after the load one
        return next((path for path, record in _records.open.items() if record is current.record), None)
    path = manifest_path.with_name(record_name(manifest_path.name))
    made = False
    try:
        mapped = _mapped(path, process)
        made = True
        record = Record(mapped)
        setattr(runner, METHOD, StepWrapper(current, record))
    except Exception as exc:
        warn_once("steps:attach", "kv-exporter: no step record for %s (%r); the model runs as before", path, exc)
        if made:
            with contextlib.suppress(OSError):
                path.unlink()
        return None
    _records.open[path] = record
    if not _records.fork_handler:
        os.register_at_fork(after_in_child=_records.close_all)
        _records.fork_handler = True
    return path


def _mapped(path: Path, process: ProcessInfo) -> mmap.mmap:
    """A new record at `path`, mapped writable: written whole aside, then renamed over whatever was there."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=path.parent)
    try:
        os.write(fd, new_record(process.pid, process.start_time_ticks))
        os.fchmod(fd, 0o644)
        mapped = mmap.mmap(fd, RECORD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    return mapped


def writer_of(path: Path) -> tuple[int, int | None] | None:
    """The pid and start time of the process whose record is at `path` (None: no readable record there)."""
    try:
        record = decode(path.read_bytes())
    except OSError:
        return None
    return None if isinstance(record, RecordProblem) else (record.pid, record.start_time_ticks or None)
