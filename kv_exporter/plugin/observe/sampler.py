"""One sample of every live cache, taken in short slices, and the thread that takes one every interval.

A sample reads metadata only (`untyped_storage().nbytes()`, `data_ptr()`, the device): no `.item()`, no copy,
no device synchronisation. It walks the caches in slices of about `SLICE_S` of work and sleeps `PAUSE_S` between
two, so another thread (the model's forward, vLLM's busy loop) never waits for the GIL much longer than a slice.
Between slices it holds no cache: a cache released meanwhile is simply not counted.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kv_exporter.cachebytes import (
    NotACache,
    NotATensor,
    SeenStorages,
    StorageUnavailable,
    held_bytes,
    inner_caches,
    new_storage_bytes,
)
from kv_exporter.observation import UNATTRIBUTED_OWNER, Observation, UnreadableReason
from kv_exporter.plugin.observe.holders import Holders
from kv_exporter.plugin.observe.registry import Entry
from kv_exporter.plugin.oncelog import warn_once

SLICE_S = 0.0004  # work done between two pauses (a probe thread then waits ~0.1 ms more to wake)
PAUSE_S = 0.0002  # long enough for a thread waiting for the GIL to take it
STOP_TIMEOUT_S = 5.0
# Runs before publish's manifest cleanup (exitpriority 10): no sample may rewrite a manifest being removed.
EXIT_PRIORITY = 20


class Pacer:
    """Called between two units of work; pauses once a slice of work is done."""

    def __init__(self, pause: Callable[[], None] | None = None) -> None:
        self._pause = pause or (lambda: time.sleep(PAUSE_S))
        self._since = time.perf_counter()
        self.pauses = 0

    def __call__(self) -> None:
        if time.perf_counter() - self._since >= SLICE_S:
            self._pause()
            self.pauses += 1
            self._since = time.perf_counter()


@dataclass
class Totals:
    """One sample's figures: owner -> (storage bytes, cache objects), and (owner, reason) -> caches left out; of the
    bytes, those in other forms than transformers caches (holders.py): in a declaring owner's state, and stored by
    known cache classes."""

    held: dict[str, tuple[int, int]] = field(default_factory=dict)
    unreadable: Counter[tuple[str, UnreadableReason]] = field(default_factory=Counter)
    in_state: Counter[str] = field(default_factory=Counter)
    stored: Counter[str] = field(default_factory=Counter)

    def add(self, owner: str, nbytes: int, objects: int) -> None:
        held, caches = self.held.get(owner, (0, 0))
        self.held[owner] = (held + nbytes, caches + objects)


def measure(entries: Sequence[Entry], pace: Callable[[], None], holders: Holders | None = None) -> Totals:
    """The figures over the live `entries` and what `holders` finds, each storage counted once over all.

    An EncoderDecoderCache counts as one cache holding both halves; its halves are not counted again on their own.
    A cache that cannot be read costs only itself: it is left out of its owner's figures and counted by reason (a
    storage it shares with a readable cache is still counted there). A known class's stored tensor counts as one
    cache; an owner's state as one, however many tensors it holds.
    """
    halves: set[int] = set()
    for entry in entries:
        halves.update(_halves(entry))
        pace()
    seen = SeenStorages()
    totals = Totals()
    for entry in entries:
        cache = entry()
        if cache is not None and id(cache) not in halves:
            owner = UNATTRIBUTED_OWNER if entry.owner is None else entry.owner
            nbytes, reason = _held(cache, seen)
            if reason is None:
                totals.add(owner, nbytes, 1)
            else:
                totals.unreadable[owner, reason] += 1
        del cache  # held only while it is read: a reference kept across a pause would delay a release
        pace()
    if holders is not None:
        _measure_holders(holders, seen, totals, pace)
    seen.clear(pace)  # freeing 56,000 keys (1,000 caches of 28 layers) at once would take ~1.5 ms
    return totals


def _measure_holders(holders: Holders, seen: SeenStorages, totals: Totals, pace: Callable[[], None]) -> None:
    states: set[str] = set()
    for owner, tensor, stored in holders.tensors(pace):
        try:
            nbytes = new_storage_bytes(tensor, seen)
        except StorageUnavailable:
            totals.unreadable[owner, UnreadableReason.NO_STORAGE] += 1
            continue
        objects = 1 if stored or owner not in states else 0  # an owner's state is one holder
        if not stored:
            states.add(owner)
        totals.add(owner, nbytes, objects)
        (totals.stored if stored else totals.in_state)[owner] += nbytes
        del tensor
        pace()


def _halves(entry: Entry) -> list[int]:
    cache = entry()
    try:
        return [] if cache is None else [id(half) for half in inner_caches(cache)]
    except Exception:  # its layers cannot be read: `_held` says why
        return []


def _held(cache: object, seen: SeenStorages) -> tuple[int, UnreadableReason | None]:
    """The cache's bytes not in `seen` yet, or why it cannot be read (then nothing of it is added to `seen`)."""
    try:
        return held_bytes(cache, seen), None
    except StorageUnavailable:
        return 0, UnreadableReason.NO_STORAGE
    except NotACache:
        return 0, UnreadableReason.NO_LAYERS
    except NotATensor:
        return 0, UnreadableReason.NOT_A_TENSOR
    except Exception:
        return 0, UnreadableReason.LAYERS_RAISED


class Sampler:
    """A daemon thread calling `take` every `interval_s` seconds and handing the result to `on_sample`."""

    def __init__(
        self, interval_s: float, take: Callable[[], Observation], on_sample: Callable[[Observation], None]
    ) -> None:
        self.interval_s = interval_s
        self.on_sample = on_sample
        self._take = take
        self._stopping = threading.Event()
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="kv-exporter-observe", daemon=True)
        self._thread.start()
        atexit.register(self.stop)
        # vLLM's workers end in os._exit after multiprocessing's own finalizers, which skips atexit.
        self._finalizer = multiprocessing.util.Finalize(None, self.stop, exitpriority=EXIT_PRIORITY)

    @property
    def running(self) -> bool:
        """False in a forked child: the thread stayed in the parent."""
        return self._pid == os.getpid() and self._thread.is_alive() and not self._stopping.is_set()

    def stop(self) -> None:
        self._stopping.set()
        atexit.unregister(self.stop)
        self._finalizer.cancel()
        if self._pid == os.getpid() and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(STOP_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            observation = self._take()
            if self._stopping.is_set():  # stopped meanwhile: the manifests may be being removed
                return
            try:
                self.on_sample(observation)
            except Exception as exc:
                warn_once(
                    "observe:on-sample", "kv-exporter: handling an observation failed (%s); still sampling", repr(exc)
                )
