"""Load for real-engine tests: clients sending completions back to back until stopped.

A burst of tiny-model completions finishes in well under a second on these cores, shorter than a scrape interval,
so tests that must *see* requests running keep the engine busy for a set time instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class LoadGenerator:
    """`clients` threads, each calling `send(client, n)` back to back until `stop()`; errors are kept."""

    def __init__(self, send: Callable[[int, int], object], clients: int) -> None:
        self.send = send
        self.errors: list[BaseException] = []
        self.completed = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                self.send(client, n)
            except BaseException as exc:
                with self._lock:
                    self.errors.append(exc)
                return
            with self._lock:
                self.completed += 1
            n += 1

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)

    def __enter__(self) -> LoadGenerator:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
