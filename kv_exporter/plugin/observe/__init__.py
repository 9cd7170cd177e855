"""Observed beside declared: what the live transformers caches of this worker really hold, per owner.

The plugin's `register()` adds `CACHE_MODULE: patch_cache_module` to its post-import hook (`patches`), so the
cache base class is patched when transformers defines it; with KV_EXPORTER_OBSERVE_INTERVAL=0 nothing is patched
and no thread starts. The publisher, once the model is loaded, calls `attach(model, declaring_owner_paths,
device)` and `start(on_sample)`; `observe()` takes one sample now. Every failure here degrades the observation
(`ObservationState.UNAVAILABLE` or `FAILING`, with a reason and one warning); none reaches transformers or vLLM.

torch and transformers are never imported here: the patch runs when transformers has imported both.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from kv_exporter.dtypes import dtype_name
from kv_exporter.observation import CudaUnavailable, Observation, ObservationState, OwnerObservation, UnreadableCaches
from kv_exporter.plugin.observe.cuda import CudaAllocator
from kv_exporter.plugin.observe.holders import Holders
from kv_exporter.plugin.observe.owners import Geometry
from kv_exporter.plugin.observe.registry import Figures, Registry
from kv_exporter.plugin.observe.sampler import PAUSE_S, SLICE_S, Pacer, Sampler
from kv_exporter.plugin.oncelog import warn_once
from kv_exporter.plugin.settings import HookSettings

__all__ = ["CACHE_MODULE", "attach", "declared_geometries", "observe", "patch_cache_module", "patches", "start", "stop"]

CACHE_MODULE = "transformers.cache_utils"
CACHE_BASE = "Cache"


class _Observer:
    """This process's observation: the registry of live caches (and the model), the device, the thread."""

    def __init__(self) -> None:
        self.registry = Registry()
        self.holders = Holders.active = Holders()  # the other forms model-local KV takes
        self.interval_s: float | None = None  # from the environment, read once
        self.peak: bool | None = None  # KV_EXPORTER_OBSERVE_PEAK, likewise
        self.cuda = CudaAllocator()
        self.sampler: Sampler | None = None
        self._transformers_missing: bool | None = None

    def interval(self) -> float:
        if self.interval_s is None:
            self.interval_s = HookSettings.from_environ().observe_interval_s
        return self.interval_s

    def follows_peaks(self) -> bool:
        if self.peak is None:
            self.peak = HookSettings.from_environ().observe_peak
        return self.peak

    def transformers_missing(self) -> bool:
        if self._transformers_missing is None:
            try:
                self._transformers_missing = importlib.util.find_spec("transformers") is None
            except (ImportError, ValueError):  # an import blocker, or sys.modules["transformers"] = None
                self._transformers_missing = True
        return self._transformers_missing

    def observe(self, pause: Callable[[], None] | None = None, warm_up_ended: bool = False) -> Observation:
        interval = self.interval()
        if interval <= 0:
            return Observation(ObservationState.OFF, "", 0.0, 0.0, 0.0)
        taken_at, started = time.time(), time.perf_counter()
        reason = self.unavailable_reason()
        if reason:
            return self._result(ObservationState.UNAVAILABLE, reason, taken_at, started, warm_up_ended)
        pause = pause or (lambda: time.sleep(PAUSE_S))
        try:
            self.holders.walk_state(Pacer(pause))  # first: what it finds is read with the caches
            figures = owners(self.registry.sample(pause, SLICE_S), self.registry)
        except Exception as exc:
            reason = f"the sample failed: {exc!r}"
            warn_once("observe:failing", "kv-exporter: %s; trying again at the next interval", reason)
            return self._result(ObservationState.FAILING, reason, taken_at, started, warm_up_ended)
        for left_out in figures[1]:
            warn_once(
                f"observe:unreadable:{left_out.reason.value}",
                "kv-exporter: %d cache(s) of %r cannot be read (%s); left out of its figures",
                left_out.caches,
                left_out.owner,
                left_out.reason.value,
            )
        return self._result(ObservationState.OK, "", taken_at, started, warm_up_ended, figures)

    def unavailable_reason(self) -> str:
        if self.registry.unavailable:
            return self.registry.unavailable
        if self.registry.installed_on is None and self.transformers_missing():
            warn_once("observe:no-transformers", "kv-exporter: transformers is not installed; no caches to observe")
            return "transformers is not installed"
        return ""

    def _result(
        self,
        state: ObservationState,
        reason: str,
        taken_at: float,
        started: float,
        warm_up_ended: bool,
        figures: tuple[tuple[OwnerObservation, ...], tuple[UnreadableCaches, ...]] = ((), ()),
    ) -> Observation:
        if warm_up_ended:
            self.cuda.mark_warm(sum(owner.bytes for owner in figures[0]))
        cuda = self.cuda.read()
        unavailable = None if cuda is not None else self.cuda.unavailable_reason() or CudaUnavailable.STATS_FAILED
        duration = time.perf_counter() - started
        peaks = self.registry.follows_peaks
        return Observation(
            state, reason, self.interval(), taken_at, duration, figures[0], cuda, figures[1], peaks, unavailable
        )


def owners(figures: Figures, registry: Registry) -> tuple[tuple[OwnerObservation, ...], tuple[UnreadableCaches, ...]]:
    """Per owner: what it held at the sample in every form, and the most it held at any instant since the previous
    one, the forms together (never below the sample's figure). Where the peak is not followed, the figure at the
    sample is the peak. Its holders: its caches, each tensor a known class stored, and its state as one.

    A declarer holding nothing shows 0, and so does an owner whose caches came and went since the last sample."""
    held, unreadable = figures
    model = registry.model
    names = {*held, *(model.declaring if model is not None else ())}
    found = []
    for owner in sorted(names):
        nbytes, peak, caches, stored, state = held.get(owner, (0, 0, 0, 0, 0))
        holders = caches + stored + (1 if state else 0)
        found.append(OwnerObservation(owner, nbytes, holders, max(nbytes, peak) if registry.follows_peaks else nbytes))
    left_out = tuple(UnreadableCaches(owner, reason, count) for (owner, reason), count in sorted(unreadable.items()))
    return tuple(found), left_out


_observer = _Observer()


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's other threads: a catch-up one of them had in progress never ends."""
    tracker = _observer.registry.tracker
    if tracker is not None:
        tracker.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def patch_cache_module(module: ModuleType) -> None:
    """The post-import patch of `CACHE_MODULE`: track every cache from now on."""
    cache_base = getattr(module, CACHE_BASE, None)
    torch: Any = sys.modules.get("torch")
    if not isinstance(cache_base, type) or torch is None:
        _observer.registry.mark_unavailable("no-cache-class", f"{module.__name__} has no {CACHE_BASE} class")
        return
    _observer.registry.install(cache_base, torch.nn.Module, _observer.follows_peaks())
    _observer.holders.tracker = _observer.registry.tracker


def patches(settings: HookSettings) -> dict[str, Callable[[ModuleType], None]]:
    """What the plugin's post-import hook patches for observation (nothing when it is off).

    Also fixes this process's interval and peak following to those in `settings`.
    """
    _observer.interval_s = settings.observe_interval_s
    _observer.peak = settings.observe_peak
    return {CACHE_MODULE: patch_cache_module, **_observer.holders.patches()} if settings.observing else {}


def attach(model: object, declarations: Iterable[Any], device: object = None, engine_kv: Iterable[Any] = ()) -> None:
    """Attribute caches to `model`'s modules from now on, and those created before (during load) now.

    `declarations`: the manifest's (owner, layers, kv_heads, head_dim, dtype are read), or owner paths alone (owners
    whose geometry is unknown: a cache a module below one makes is never charged to it). `device`: the worker's torch
    device (a CUDA one adds the allocator's figures, observe/cuda.py); `engine_kv`: the engine's paged KV tensors
    (the runner's `kv_caches`), never counted as model-local. Call this from the worker's own thread. Never raises.
    """
    if _observer.interval() <= 0:
        return
    try:
        torch: Any = sys.modules.get("torch")
        module_type = torch.nn.Module if torch is not None else object
        _observer.cuda.attach(device)
        registry = _observer.registry
        registry.attach(model, declared_geometries(declarations), module_type)
        if registry.model is not None:
            _observer.holders.attach(registry.model, registry.installed_on, module_type, engine_kv)
    except Exception as exc:
        warn_once("observe:attach", "kv-exporter: cannot attribute caches to the model's modules (%s)", repr(exc))


def declared_geometries(declarations: Iterable[Any]) -> dict[str, set[Geometry]]:
    """Each declaring owner's path -> the geometries its declarations give a cache's K and V tensors."""
    declared: dict[str, set[Geometry]] = {}
    for d in declarations:
        if isinstance(d, str):
            declared.setdefault(d, set())
        else:
            geometry = Geometry(int(d.layers), int(d.kv_heads), int(d.head_dim), dtype_name(d.dtype))
            declared.setdefault(d.owner, set()).add(geometry)
    return declared


def observe(pause: Callable[[], None] | None = None, warm_up_ended: bool = False) -> Observation:
    """One sample now, in this thread (paused between slices with `pause`, default a short sleep). `warm_up_ended`:
    the engine has just finished its warm-up; the allocator's figures now are what later growth is measured from."""
    return _observer.observe(pause, warm_up_ended)


def start(on_sample: Callable[[Observation], None]) -> bool:
    """Sample every KV_EXPORTER_OBSERVE_INTERVAL seconds in a daemon thread; False (and no thread) when off.

    Idempotent: a running sampler only takes the new `on_sample`. The thread stops at exit, before the
    manifests are cleaned up.
    """
    interval = _observer.interval()
    if interval <= 0:
        return False
    sampler = _observer.sampler
    if sampler is not None and sampler.running:
        sampler.on_sample = on_sample
        return True
    try:
        _observer.sampler = Sampler(interval, _observer.observe, on_sample)
    except Exception as exc:
        warn_once("observe:start", "kv-exporter: cannot start the observation thread (%s)", repr(exc))
        return False
    return True


def stop() -> None:
    if _observer.sampler is not None:
        _observer.sampler.stop()
