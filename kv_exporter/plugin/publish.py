"""Build, log and write one worker's manifest. Never raises: reporting memory must not break model load."""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import multiprocessing.util
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kv_exporter.gpu import GpuReader
from kv_exporter.manifest import (
    Manifest,
    ManifestError,
    Phase,
    ProcessInfo,
    parse_manifest,
    write_manifest,
)
from kv_exporter.observation import Observation
from kv_exporter.plugin import baseline, identity, kv_budget, observe, steps
from kv_exporter.plugin.collect import collect, to_declarations
from kv_exporter.plugin.forksafe import ForkSafeLock
from kv_exporter.plugin.oncelog import logger, warn_once
from kv_exporter.plugin.settings import HookSettings

MIB = 1 << 20
# Errors that mean "this process may not write there" (not "the disk is full"): only these send a default
# folder to the fallback.
_NOT_PERMITTED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


def publish(
    runner: Any, phase: Phase, settings: HookSettings | None = None, reader: GpuReader | None = None
) -> Path | None:
    """Publish `runner`'s declarations; the manifest path, or None when nothing was written.

    `reader` is the GPU reader for the baseline (default: the process's shared NVML reader).
    """
    try:
        settings = settings or HookSettings.from_environ()
        if settings.disabled:
            return None
        manifest = build_manifest(runner, phase, settings, reader)
        with _published.lock:  # a sample landing meanwhile must not write back the previous phase's manifest
            path = write(manifest, settings)
            if path is not None:
                _published.manifests[path] = manifest
        log_summary(manifest, path)
        if path is not None:
            record = steps.attach(runner, path, manifest.process) if settings.step_record else None
            if record is not None:  # removed before the manifest: a record never outlives its manifest
                _cleanup.track(record, manifest.process, steps.writer_of)
            _cleanup.track(path, manifest.process, manifest_writer)
            observe.start(_published.observed)
        return path
    except Exception as exc:
        warn_once(
            "publish", "kv-exporter: publishing the %s manifest failed (%r); model load goes on", phase.value, exc
        )
        return None


def build_manifest(runner: Any, phase: Phase, settings: HookSettings, reader: GpuReader | None = None) -> Manifest:
    model = getattr(runner, "model", None)
    collector, pairs = collect(model, settings.collector)
    declarations = to_declarations(pairs)
    device, base = baseline.measure(runner, identity.device_info(runner), reader)
    # Attribute the caches to this model's modules (those made during load too), then take the first sample.
    observe.attach(model, declarations, getattr(runner, "device", None), getattr(runner, "kv_caches", None) or ())
    manifest = Manifest(
        engine=identity.engine_identity(runner),
        process=ProcessInfo.current(),
        device=device,
        max_num_seqs=identity.max_num_seqs(runner),
        phase=phase,
        collector=collector,
        declarations=declarations,
        baseline=base,
        pod=identity.pod_info(),
        observation=observe.observe(warm_up_ended=phase is Phase.WARMUP),
        engine_memory=kv_budget.engine_memory(runner),
    )
    try:  # the sidecar reads strictly: say here, once, if it is going to reject this file
        parse_manifest(manifest.to_json().encode(), "<kv-exporter hook>")
    except ManifestError as exc:
        warn_once("invalid", "kv-exporter: the sidecar will reject this manifest: %s: %s", exc.reason, exc.detail)
    return manifest


def write(manifest: Manifest, settings: HookSettings) -> Path | None:
    try:
        return write_manifest(settings.directory, manifest)
    except OSError as exc:
        if settings.explicit_directory or exc.errno not in _NOT_PERMITTED:
            warn_once(
                f"write:{exc.errno}",
                "kv-exporter: cannot write the manifest into %s (%s); model load goes on without it",
                settings.directory,
                exc,
            )
            return None
    fallback = settings.fallback_directory
    try:
        path = write_manifest(fallback, manifest)
    except OSError as exc:
        warn_once(
            f"write-fallback:{exc.errno}", "kv-exporter: cannot write the manifest into %s either (%s)", fallback, exc
        )
        return None
    warn_once(
        "fallback",
        "kv-exporter: %s is not writable by this process; wrote %s instead (set KV_EXPORTER_DIR for engine and "
        "sidecar alike)",
        settings.directory,
        path,
    )
    return path


def log_summary(manifest: Manifest, path: Path | None) -> None:
    """The design notes' summary: the total at max_num_seqs, then one line per declaration."""
    seqs = manifest.max_num_seqs
    total = manifest.declared_peak_bytes()
    logger.info(
        "kv-exporter [%s]: model-local KV (outside the paged manager): %.2f MiB (%d B) across %d declaration(s) "
        "at max_num_seqs=%d; collector=%s; manifest %s",
        manifest.phase.value,
        total / MIB,
        total,
        len(manifest.declarations),
        seqs,
        manifest.collector,
        path if path is not None else "not written",
    )
    for d in manifest.declarations:
        driver = f"{d.rows.value}({d.rows_fixed}; {d.rows_reason})" if d.rows.count_stated else d.rows.value
        logger.info(
            "  %s.%s: %.2f MiB (%d rows from %s x %d B/row, scope=%s, %d positions from %s)",
            d.owner or "<root>",
            d.name,
            d.peak_bytes(seqs) / MIB,
            d.row_count(seqs),
            driver,
            d.bytes_per_row,
            d.scope.value,
            d.physical_capacity_positions,
            d.capacity_source,
        )


class _Published:
    """The manifests this process published, rewritten with each new observation (in the sampler's thread)."""

    def __init__(self) -> None:
        # Fresh in a forked child (compile workers, a model-registry subprocess), which may publish too.
        self.lock = ForkSafeLock()
        self.manifests: dict[Path, Manifest] = {}

    def observed(self, observation: Observation) -> None:
        with self.lock:
            for path, manifest in self.manifests.items():
                current = replace(manifest, observation=observation, written_at=time.time())
                try:
                    write_manifest(path.parent, current)
                except OSError as exc:
                    warn_once(
                        f"observed:{exc.errno}", "kv-exporter: cannot rewrite %s with an observation (%s)", path, exc
                    )
                    continue
                self.manifests[path] = current


_published = _Published()


Writer = Callable[[Path], "tuple[int, int | None] | None"]  # the pid and start time of a file's writer


def manifest_writer(path: Path) -> tuple[int, int | None] | None:
    try:
        written = json.loads(path.read_bytes())["process"]
        return written["pid"], written["start_time_ticks"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _Cleanup:
    """Removes this process's manifests and step records at a clean exit, unless another process has since replaced
    them."""

    def __init__(self) -> None:
        self.owned: dict[Path, tuple[ProcessInfo, Writer]] = {}
        self.registered = False

    def track(self, path: Path, process: ProcessInfo, writer: Writer) -> None:
        self.owned[path] = (process, writer)
        if not self.registered:
            atexit.register(self.run)
            # vLLM's workers are multiprocessing children: they end in os._exit, which skips atexit but first
            # runs multiprocessing's own exit finalizers.
            multiprocessing.util.Finalize(None, self.run, exitpriority=10)
            self.registered = True

    def run(self) -> None:
        for path, (process, writer) in list(self.owned.items()):
            # A forked child inherits this handler; only the writer removes its file.
            if process.pid != os.getpid():
                continue
            if writer(path) == (process.pid, process.start_time_ticks):
                with contextlib.suppress(OSError):
                    path.unlink()
            self.owned.pop(path, None)


_cleanup = _Cleanup()
