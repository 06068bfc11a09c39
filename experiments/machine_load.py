"""How busy the machine is besides us: a gate before measuring, and an account after.

Benchmarks on a shared machine measure the neighbours as much as the server. The gate
waits (bounded) until the 1-minute load average is low; the account compares the CPU
time the whole machine spent (`/proc/stat`) with what this process and its reaped
children spent (`os.times`), so a report can say how much of the cores others took
while it measured. Children must have been waited for to count (a stopped server's
instances are reaped by the server, whose total reaches us when we reap it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


def load_average() -> float:
    return os.getloadavg()[0]


def wait_for_quiet(max_load: float, timeout_s: float, poll_s: float = 30.0, log=print) -> float:
    """Polls until the 1-minute load average is below `max_load`; returns it.

    Raises TimeoutError when it stays above for `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        load = load_average()
        if load < max_load:
            return load
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"the 1-minute load average stayed at or above {max_load:g} for "
                f"{timeout_s:.0f} s (now {load:.2f}): the machine is busy, not measuring"
            )
        log(f"load average {load:.2f} >= {max_load:g}: waiting ({remaining:.0f} s left)")
        time.sleep(min(poll_s, remaining))


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent out of idle since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@dataclass
class CpuAccount:
    """CPU used by the machine and by us between `start()` and `stop()`."""

    started_at: float  # time.monotonic()
    busy_at_start: float  # the whole machine's busy CPU seconds
    own_at_start: float  # this process's and its reaped children's
    load_at_start: float  # the 1-minute load average

    @classmethod
    def start(cls) -> CpuAccount:
        return cls(time.monotonic(), machine_busy_seconds(), own_seconds(), load_average())

    def stop(self) -> dict:
        wall = max(time.monotonic() - self.started_at, 1e-9)
        cores = os.cpu_count() or 1
        busy = machine_busy_seconds() - self.busy_at_start
        own = own_seconds() - self.own_at_start
        return {
            "wall_s": wall,
            "cores": cores,
            "load_average_start": self.load_at_start,
            "load_average_end": load_average(),
            "own_cpu_share": own / (wall * cores),
            "others_cpu_share": max(0.0, busy - own) / (wall * cores),
        }
