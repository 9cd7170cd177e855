"""Stopping a long-running command on SIGTERM or SIGINT, safely however many signals arrive and whenever.

A signal handler runs in the main thread between two bytecodes, possibly while that thread is inside a lock (an
`Event.set()` in an earlier handler, a logging call): a handler that takes a lock can wait for itself for ever.
So the handlers here take none. The interpreter's own C-level handler writes each signal's number to a socket
(`signal.set_wakeup_fd`, whichever thread the kernel delivered it to); the main thread blocks reading that socket
and stops on the first stop signal it reads. Later signals only add bytes, and a full socket drops them.

The one thing a handler does itself: a SIGINT after a stop was asked for ends the process at once (a person pressing
Ctrl-C a second time), with 130, the shell's status for an interrupted command. A watchdog bounds the graceful stop:
a process that has not left `bound_s` after the first signal is ended with status 1, whatever it is waiting for.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
INTERRUPTED_STATUS = 128 + signal.SIGINT  # a second SIGINT: leave at once
OVERDUE_STATUS = 1  # the graceful stop outlasted its bound


class StopRequest:
    """The stop handling of this process, from `install` until the process ends.

    It is never uninstalled: signals that arrive while the command shuts down, or after, must not find the default
    SIGTERM action (death by signal) waiting for them.
    """

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.asked = False  # set by the handler: a plain store, no lock
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)  # the C handler must never block on a full socket

    @classmethod
    def install(cls, bound_s: float) -> StopRequest:
        """From the main thread, before the command starts anything: a signal during start-up is kept, not lost."""
        request = cls(bound_s)
        signal.set_wakeup_fd(request._writer.fileno(), warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, request._handle)
        return request

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.asked:
            os._exit(INTERRUPTED_STATUS)
        self.asked = True

    def wait(self) -> int:
        """Block until a stop signal arrives (or has arrived since `install`); return its number."""
        while True:
            for number in self._reader.recv(64):
                if number in STOP_SIGNALS:
                    self._start_watchdog()
                    return number

    @staticmethod
    def finished() -> None:
        """The command has shut down: stop signals are ignored while the process leaves. Interpreter finalization
        restores the default action of every signal with a Python handler, and a SIGTERM then kills the process
        (status -15) after a clean stop; it leaves ignored signals alone."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _start_watchdog(self) -> None:
        def overdue() -> None:
            # Straight to the file descriptor: a logging lock held by a stuck thread must not hold this up too.
            os.write(2, b"kv-exporter: did not stop within %.0f s of the stop signal: exiting now\n" % self.bound_s)
            os._exit(OVERDUE_STATUS)

        watchdog = threading.Timer(self.bound_s, overdue)
        watchdog.daemon = True  # it must not hold up a stop that finishes in time
        watchdog.start()
