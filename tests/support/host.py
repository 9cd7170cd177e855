"""What the machine did to the test's processes over a stretch of a test, for a failure message: whether a scrape
was late because the product was slow or because the host held the scraper and the sidecar off the CPU (on these
2-core machines it has, for tens of seconds under an engine's load).

Read from the kernel's own accounts: each process's time waiting on a run queue (`/proc/PID/task/*/schedstat`, its
threads together), the time the hypervisor took the CPUs (`steal` in `/proc/stat`) and the pressure stall totals
(`/proc/pressure/*`, where the kernel has them).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PRESSURES = (("cpu", "some"), ("io", "some"), ("io", "full"), ("memory", "some"))


@dataclass(frozen=True)
class HostTimes:
    at: float  # CLOCK_MONOTONIC
    pids: dict[str, int]  # the processes watched, by name
    waited_s: dict[int, float]  # pid -> its threads' total run-queue wait; absent once it is gone
    steal_s: float
    stalled_s: dict[str, float]  # "cpu some" -> total seconds some task stalled on it


def host_times(pids: dict[str, int]) -> HostTimes:
    """Now, for the named processes (e.g. {"test": os.getpid(), "sidecar": sidecar.pid})."""
    waited = {pid: wait for pid in pids.values() if (wait := _run_queue_wait_s(pid)) is not None}
    return HostTimes(time.monotonic(), pids, waited, _steal_s(), _stalled_s())


def since(before: HostTimes) -> str:
    """What happened to `before`'s processes from then to now, in words."""
    now = host_times(before.pids)
    waits = ", ".join(
        f"{name}'s threads waited {now.waited_s[pid] - before.waited_s[pid]:.1f} s for a CPU"
        for name, pid in before.pids.items()
        if pid in now.waited_s and pid in before.waited_s
    )
    stalls = ", ".join(
        f"{kind} {now.stalled_s[kind] - before.stalled_s[kind]:.1f} s"
        for kind in now.stalled_s
        if kind in before.stalled_s
    )
    return (
        f"over {now.at - before.at:.1f} s: {waits or 'no process accounts'}; the hypervisor took "
        f"{now.steal_s - before.steal_s:.1f} CPU-s; pressure stalls: {stalls or 'not kept by this kernel'}"
    )


def _run_queue_wait_s(pid: int) -> float | None:
    """The run-queue wait of all the process's threads together (the sidecar answers from a thread of its own)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    waited = 0
    for task in tasks:
        try:
            waited += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return waited / 1e9


def _steal_s() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()
    return int(fields[8]) / TICKS_PER_S  # cpu user nice system idle iowait irq softirq steal


def _stalled_s() -> dict[str, float]:
    stalled = {}
    for resource, kind in PRESSURES:
        try:
            lines = Path(f"/proc/pressure/{resource}").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith(kind + " "):
                stalled[f"{resource} {kind}"] = int(line.rsplit("total=", 1)[1]) / 1e6
    return stalled
