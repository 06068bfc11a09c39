"""What becomes of a request whose step failed on an instance (`RequestDelta.step_failed`).

The instance dropped it; the gateway sends it elsewhere rather than fail it, so a
broken instance costs its requests a move, not an error. Each failed step that may
have been the request's own doing is a strike (`GenerateTask.step_failures`): with one
it goes to another instance on probation (run there one such request at a time,
`instance/probation.py`); a second failed step ends it with the step's reason, never
sent a third time, so one poison request cannot walk through the pool failing every
batch it joins. A bystander (a step blamed on another request on probation) moves
without a strike. Every move counts against `--max-request-retries` like any retry.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pdserve.common.messages import STEP_SUSPECT, GenerateTask, RequestDelta

MAX_STEP_FAILURES = 2  # instances a request may fail a step on before it ends


@dataclass(frozen=True)
class Move:
    """Send `task` elsewhere (the reason in `why`), or end the request with `fail`."""

    task: GenerateTask | None = None
    why: str = ""
    fail: str = ""


def next_move(
    task: GenerateTask, delta: RequestDelta, instance_id: str, attempts: int, max_attempts: int
) -> Move:
    reason = delta.error or "its step failed"
    strikes = task.step_failures + (delta.step_failed == STEP_SUSPECT)
    if strikes >= MAX_STEP_FAILURES:
        return Move(fail=f"{reason} (a step with it failed on {strikes} instances)")
    if attempts >= max_attempts:
        return Move(fail=f"{reason} (sent {attempts} times, --max-request-retries)")
    moved = msgspec.structs.replace(task, step_failures=strikes)
    return Move(task=moved, why=f"a step failed on {instance_id}: {reason}")
