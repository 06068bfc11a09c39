"""Whether processes the tests killed (or expect to die) are gone, read from /proc."""

from __future__ import annotations

import time
from collections.abc import Iterable


def running(pid: int) -> bool:
    """A live process; a zombie (dead, not yet reaped by its parent) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def still_running(pids: Iterable[int], timeout_s: float) -> list[int]:
    """The pids still running once all are gone or `timeout_s` has passed."""
    pids = list(pids)
    deadline = time.monotonic() + timeout_s
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if running(pid)]
