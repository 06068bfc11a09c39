"""Requests on probation: those that failed a step on another instance.

A failed step fails every request in it, and the instance cannot tell which one
caused it. So the gateway sends them elsewhere, counting a strike against each
(`GenerateTask.step_failures`), and the instance that receives them runs them one at
a time: one on trial beside its healthy traffic, the others waiting here, out of the
scheduler. The one on trial is cleared once a step computed it without failing (or it
left the scheduler); the next then goes on trial. If a step fails while one is on
trial, that one is blamed: a second strike, so it ends with the step's reason and is
not sent again, and the step does not count toward the breaker; the other requests of
the step move on without a strike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pdserve.common.messages import GenerateTask
from pdserve.scheduler.step_scheduler import Scheduler


class Probation:
    def __init__(self) -> None:
        self.on_trial: str | None = None
        self._waiting: deque[GenerateTask] = deque()

    def __len__(self) -> int:
        return len(self._waiting) + (self.on_trial is not None)

    def admit(self, task: GenerateTask) -> bool:
        """Whether the task may enter the scheduler now (False: it waits here)."""
        if task.step_failures <= 0:
            return True
        if self.on_trial is None:
            self.on_trial = task.request_id
            return True
        self._waiting.append(task)
        return False

    def clear(self, scheduler: Scheduler) -> list[GenerateTask]:
        """After a successful step: the one on trial is cleared once it was computed or
        left the scheduler; returns the next to admit (it is on trial from now)."""
        if self.on_trial is not None:
            request = scheduler.requests.get(self.on_trial)
            if request is not None and request.num_computed_tokens == 0:
                return []  # not stepped yet: still on trial
            self.on_trial = None
        return self._next()

    def blame(self) -> str | None:
        """A step failed: the one on trial is the suspect (None if nobody is)."""
        suspect, self.on_trial = self.on_trial, None
        return suspect

    def drop(self, request_ids: Iterable[str]) -> None:
        """Aborted requests leave probation (waiting or on trial)."""
        ids = set(request_ids)
        self._waiting = deque(t for t in self._waiting if t.request_id not in ids)
        if self.on_trial in ids:
            self.on_trial = None

    def _next(self) -> list[GenerateTask]:
        if self.on_trial is None and self._waiting:
            task = self._waiting.popleft()
            self.on_trial = task.request_id
            return [task]
        return []
