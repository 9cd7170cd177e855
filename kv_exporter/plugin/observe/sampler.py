"""How a sample paces its work, and the thread that takes a sample every interval.

Every figure comes from the tracker's ledger (registry.py, `_tracker.c`): a sample reads only what changed since it
was last read (and a declaring owner's state, holders.py), in slices of about `SLICE_S` of work with a `PAUSE_S`
pause between two, so another thread (the model's forward, vLLM's busy loop) never waits for the GIL much longer than
a slice. Reading is metadata only (`untyped_storage().nbytes()`, `data_ptr()`): no `.item()`, no copy, no device
synchronisation; no cache or tensor is held across a pause.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import threading
import time
from collections.abc import Callable

from kv_exporter.observation import Observation
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
