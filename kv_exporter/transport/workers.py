"""Threads that run blocking work for the server's loop: each job's result comes back as a future of that loop.

Not `concurrent.futures.ThreadPoolExecutor`: its threads are joined when the interpreter exits, so one job stuck in a
call that never returns would hold up the exit; these are daemons. Threads start as jobs need them, up to `size`.
Answers finished together (the scrapes sharing one collection) wake the loop once: a wake-up each cost ~10% more
CPU a scrape at 32 scrapers.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[Any], Any], Any]


class Workers:
    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._done: list[tuple[asyncio.Future[Any], Any, bool]] = []  # (future, result or exception, failed)
        self._waking = False  # a wake-up of the loop is on its way

    def submit(self, work: Callable[[T], Any], arg: T) -> asyncio.Future[Any]:
        """On the loop: `work(arg)` in a worker; the future gets its result (or its exception)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._jobs.put((loop, future, work, arg))
        with self._lock:
            if self._idle:
                self._idle -= 1  # that worker's job now
            elif len(self._threads) < self._size:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def close(self) -> None:
        """Let each worker end once the jobs before are done."""
        with self._lock:
            for _ in self._threads:
                self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, work, arg = job
            try:
                outcome: tuple[Any, bool] = (work(arg), False)
            except Exception as exc:
                outcome = (exc, True)
            with self._lock:
                self._idle += 1
                self._done.append((future, *outcome))
                wake, self._waking = not self._waking, True
            if wake:  # one wake-up of the loop for the answers finished together (a shared collection's)
                with contextlib.suppress(RuntimeError):  # the loop has ended: nobody waits for the answers
                    loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            done, self._done, self._waking = self._done, [], False
        for future, value, failed in done:
            if future.done():
                continue
            if failed:
                future.set_exception(value)
            else:
                future.set_result(value)
