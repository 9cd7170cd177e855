"""What /proc says about a process: its start time and its pid namespace.

The hook records both in a manifest; the sidecar reads them back to tell a live writer from a dead or reused pid
(`kv_exporter.sidecar.liveness`) and to know whether NVML's host pids compare with a manifest's.
"""

from __future__ import annotations

import os
import select
from collections.abc import Collection

# NVML reports pids as the host sees them: in the initial pid namespace (the kernel's PROC_PID_INIT_INO).
HOST_PID_NAMESPACE = "pid:[4026531836]"


def process_start_ticks(pid: int, proc: str = "/proc") -> int | None:
    """Start time of `pid` in clock ticks since boot, or None where /proc does not show it."""
    # The sidecar calls this per manifest per scrape: a raw os.read is ~4x cheaper than pathlib here.
    try:
        fd = os.open(f"{proc}/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        stat = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat.rsplit(b")", 1)[-1].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def current_pid_namespace(proc: str = "/proc") -> str | None:
    """`readlink /proc/self/ns/pid`, e.g. "pid:[4026531836]"; None where /proc does not show it."""
    try:
        return os.readlink(os.path.join(proc, "self", "ns", "pid"))
    except OSError:
        return None


# Processes watched through a pidfd at most: the rest are read from /proc each time. Each holds a descriptor, and the
# server's connections need theirs (a soft limit of 1024 is common).
MAX_WATCHED = 256


class ProcessWatch:
    """The start time of processes asked about scrape after scrape, without reading /proc for those still running.

    A process found running is watched through a pidfd (Linux 5.3): it refers to that process and no other, and
    turns readable when it exits, so one poll() over all of them says which have gone since. Its start time is read
    from /proc once, after the pidfd is open, so a pid reused in between cannot pass for the process. Where pidfds
    are refused (an older kernel, a seccomp profile), /proc is read every time, as `process_start_ticks` does. An
    exited process that is not reaped yet (a zombie) is gone here, where /proc would still show it.
    """

    def __init__(self, proc: str = "/proc", most: int = MAX_WATCHED) -> None:
        self.proc = proc
        self.most = most
        self._usable = proc == "/proc" and hasattr(os, "pidfd_open")  # a pidfd is of our own /proc's namespace
        self._watched: dict[int, tuple[int, int]] = {}  # pid -> (pidfd, start ticks)
        self._poll = select.poll()

    def start_ticks(self, pids: Collection[int]) -> dict[int, int | None]:
        """Each pid's start time in clock ticks since boot, None where no such process runs. Processes not asked
        about are no longer watched."""
        for fd, _ in self._poll.poll(0):  # exited since the last call
            self._forget(next(pid for pid, (pidfd, _) in self._watched.items() if pidfd == fd))
        for pid in [pid for pid in self._watched if pid not in pids]:
            self._forget(pid)
        return {pid: self._ticks(pid) for pid in pids}

    def _ticks(self, pid: int) -> int | None:
        known = self._watched.get(pid)
        if known is not None:
            return known[1]
        if not self._usable or len(self._watched) >= self.most:
            return process_start_ticks(pid, self.proc)
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        except OSError:  # refused here: read /proc from now on
            self._usable = False
            return process_start_ticks(pid, self.proc)
        ticks = process_start_ticks(pid, self.proc)
        if ticks is None or _exited(pidfd):  # a zombie: /proc still shows it
            os.close(pidfd)
            return None
        self._watched[pid] = (pidfd, ticks)
        self._poll.register(pidfd, select.POLLIN)
        return ticks

    def _forget(self, pid: int) -> None:
        pidfd, _ = self._watched.pop(pid)
        self._poll.unregister(pidfd)
        os.close(pidfd)

    def close(self) -> None:
        for pid in list(self._watched):
            self._forget(pid)


def _exited(pidfd: int) -> bool:
    """Whether the process has exited (its pidfd is readable); poll, not select: descriptors past 1024 are common."""
    one = select.poll()
    one.register(pidfd, select.POLLIN)
    return bool(one.poll(0))
