"""The instance's circuit breaker: an instance whose steps keep failing says so.

A step that raises fails its requests (they move to other instances), but the loop
turns on and heartbeats go out, so without this an instance with a sticky fault (a
CUDA error that every kernel hits again, a dead KV transfer thread) would look alive
and keep receiving traffic. The breaker counts steps that failed in a row; once
`max_failed_steps` have, or they have kept failing for `max_failing_s`, it trips for
good: the instance reports itself unhealthy on every output and heartbeat
(`InstanceOutput.unhealthy`) and the gateway fences it like a stalled one (killed and
replaced, its requests sent on). A failed step blamed on a request on probation (one
that failed a step elsewhere: `instance/probation.py`) does not count: one poison
request must not fence the instances it passes through. Any successful step resets it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MAX_FAILED_STEPS = 3
MAX_FAILING_S = 10.0


class StepBreaker:
    def __init__(
        self,
        max_failed_steps: int = MAX_FAILED_STEPS,
        max_failing_s: float = MAX_FAILING_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_failed_steps < 1 or max_failing_s <= 0:
            raise ValueError("the breaker needs max_failed_steps >= 1 and max_failing_s > 0")
        self.max_failed_steps = max_failed_steps
        self.max_failing_s = max_failing_s
        self.clock = clock
        self.failed_in_a_row = 0
        self._first_failed_at = 0.0
        self.tripped = ""  # why, once tripped (it never closes again: the instance is replaced)

    def record_success(self) -> None:
        self.failed_in_a_row = 0

    def record_failure(self, reason: str) -> str:
        """One more failed step; returns why the breaker tripped ("" while it holds)."""
        now = self.clock()
        if self.failed_in_a_row == 0:
            self._first_failed_at = now
        self.failed_in_a_row += 1
        failing_s = now - self._first_failed_at
        if not self.tripped and (
            self.failed_in_a_row >= self.max_failed_steps
            or (self.failed_in_a_row > 1 and failing_s >= self.max_failing_s)
        ):
            self.tripped = (
                f"its last {self.failed_in_a_row} steps failed ({failing_s:.1f} s), the "
                f"latest with: {reason}"
            )
        return self.tripped
