"""Which of the gateway's tasks an instance takes, by the epoch each one names.

Every task the gateway sends names the instance's epoch as the gateway believes it
current (`AddressedTask.epoch`). The instance takes a task for its current epoch and
drops one for any other, counted as `stale_epoch` on the tasks channel
(`pdserve:dropped_frames_total`): an older epoch is a life of this instance the
gateway retired (a task sent before a fence, or before a role switch, and delivered
after; a captured task replayed to a restarted process, which never heard the
gateway's seal session), a later one belongs to a successor of this process.

The role switch's rule: the gateway moves the instance from epoch e to e + 1 when the
output announcing the switch arrives (`GlobalScheduler.switch_role`), so what it sends
until then names e. After switching from e into e + 1 the instance still takes tasks
for e, until the first task for e + 1 arrives: the gateway's task socket keeps its
order, so no task for e is sent after one for e + 1, and none sent in between is
lost. A restart opens no such window: a new process starts in its epoch alone.
"""

from __future__ import annotations

import threading


class TaskEpochs:
    """The epochs whose tasks the instance takes; the step loop switches, the I/O thread
    admits."""

    def __init__(self, epoch: int) -> None:
        self._lock = threading.Lock()
        self._current = epoch
        self._previous: int | None = None  # the epoch a role switch left, still taken

    @property
    def current(self) -> int:
        return self._current

    def switch(self, epoch: int) -> None:
        """A role switch moved the instance into `epoch`: the one it leaves stays open
        until the gateway names the new one."""
        with self._lock:
            self._previous, self._current = self._current, epoch

    def admit(self, epoch: int) -> bool:
        """Whether a task naming `epoch` is for this instance as it is now."""
        with self._lock:
            if epoch == self._current:
                self._previous = None  # the gateway knows the new epoch: the old one closes
                return True
            return epoch == self._previous
