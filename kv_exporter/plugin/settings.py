"""The hook's settings, read from the environment of each vLLM process (no torch, no vllm)."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kv_exporter.manifest import COLLECTORS, DEFAULT_MANIFEST_DIR
from kv_exporter.plugin.oncelog import warn_once

ENV_DISABLE = "KV_EXPORTER_DISABLE"
ENV_DIR = "KV_EXPORTER_DIR"
ENV_COLLECTOR = "KV_EXPORTER_COLLECTOR"
ENV_OBSERVE_INTERVAL = "KV_EXPORTER_OBSERVE_INTERVAL"
ENV_OBSERVE_PEAK = "KV_EXPORTER_OBSERVE_PEAK"
ENV_STEP_RECORD = "KV_EXPORTER_STEP_RECORD"

# Seconds between two observations of the live caches; 0 turns observation off (nothing is patched).
DEFAULT_OBSERVE_INTERVAL_S = 10.0

# Used only when the default cannot be written (a non-root process outside the deploy); never for an explicit
# KV_EXPORTER_DIR, which must not be silently redirected.
FALLBACK_SUBDIR = "kv-exporter"

COLLECTOR_AUTO = "auto"
COLLECTOR_CHOICES = (COLLECTOR_AUTO, *COLLECTORS)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class HookSettings:
    disabled: bool
    directory: Path
    explicit_directory: bool  # KV_EXPORTER_DIR was set: no fallback
    collector: str  # "auto": vllm-omni's when available, else ours; or one of COLLECTORS
    observe_interval_s: float = DEFAULT_OBSERVE_INTERVAL_S  # 0: observation off
    # Follow each owner's high-water mark between samples (within 1% of a decode step, docs/benchmarks.md target 9);
    # off, only caches' creation is hooked on the step path and the peak is the figure at the sample.
    observe_peak: bool = True
    # Each step's sequences in a mapped record beside the manifest (kv_exporter/steprecord.py): the running count the
    # sidecar exports. Off, the sidecar reads it from the engine's page (--engine-url), sampled at the scrape.
    step_record: bool = True

    @property
    def observing(self) -> bool:
        return not self.disabled and self.observe_interval_s > 0

    @property
    def fallback_directory(self) -> Path:
        return Path(tempfile.gettempdir()) / FALLBACK_SUBDIR

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> HookSettings:
        env = os.environ if environ is None else environ
        folder = env.get(ENV_DIR, "").strip()
        collector = env.get(ENV_COLLECTOR, COLLECTOR_AUTO).strip().lower() or COLLECTOR_AUTO
        return cls(
            disabled=env.get(ENV_DISABLE, "").strip().lower() in _TRUE,
            directory=Path(folder or DEFAULT_MANIFEST_DIR),
            explicit_directory=bool(folder),
            collector=collector if collector in COLLECTOR_CHOICES else COLLECTOR_AUTO,
            observe_interval_s=observe_interval(env.get(ENV_OBSERVE_INTERVAL)),
            observe_peak=env.get(ENV_OBSERVE_PEAK, "").strip().lower() not in _FALSE,
            step_record=env.get(ENV_STEP_RECORD, "").strip().lower() not in _FALSE,
        )


def observe_interval(text: str | None) -> float:
    """KV_EXPORTER_OBSERVE_INTERVAL in seconds: unset or empty -> the default; a bad value -> the default, warned."""
    if text is None or not text.strip():
        return DEFAULT_OBSERVE_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        warn_once(
            "observe-interval",
            "kv-exporter: %s=%r is not a number of seconds >= 0; observing every %g s",
            ENV_OBSERVE_INTERVAL,
            text,
            DEFAULT_OBSERVE_INTERVAL_S,
        )
        return DEFAULT_OBSERVE_INTERVAL_S
    return value
