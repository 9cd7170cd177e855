"""What /proc says about a process: its start time and its pid namespace.

The hook records both in a manifest; the sidecar reads them back to tell a live writer from a dead or reused pid
(`kv_exporter.sidecar.liveness`) and to know whether NVML's host pids compare with a manifest's.
"""

from __future__ import annotations

import os

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
