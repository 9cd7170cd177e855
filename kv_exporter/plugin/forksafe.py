"""Locks a forked child gets fresh.

vLLM forks its workers, and libraries inside a worker fork too (compile pools, data loaders, tokenizers). A lock held
by another thread at the instant of a fork stays held in the child, by a thread the child does not have: its first
acquire would wait for ever. Every lock of the plugin is one of these: the child gets a new, free one (what it
guarded is consistent in the child: each is held only around plain data updates, never across a call into code that
could fork).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["ForkSafeLock"]


class ForkSafeLock:
    """A `threading.Lock` (or `RLock`, by `factory`) replaced by a free one in a forked child."""

    def __init__(self, factory: Callable[[], Any] = threading.Lock) -> None:
        self._factory = factory
        self._lock = factory()
        _locks.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return bool(self._lock.acquire(blocking, timeout))

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> ForkSafeLock:
        self._lock.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._lock.release()

    def _renew(self) -> None:
        self._lock = self._factory()


_locks: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _renew_all() -> None:
    for lock in list(_locks):
        lock._renew()


os.register_at_fork(after_in_child=_renew_all)
