"""Test hooks, the instance's only seam for them: built only for an instance started with
test hooks enabled (`pdserve serve --enable-test-hooks`), so a production instance
carries none of this and pays nothing for it.

- `LeakBlocksTask`: holds blocks for a request the scheduler does not know, so a test
  proves the idle-invariant check catches a leak;
- `PDSERVE_TEST_KV_DELAY_S`: every pull of a decode instance starts this many seconds
  after its blocks were allocated, so tests can tell the first token (from the prefill
  instance) from the rest;
- `FailStepsTask`: every step fails from now on (a sticky device fault), or every step
  while a request with a given prompt prefix is on the instance (a poison request), so
  the chaos suite can prove the circuit breaker and probation.
"""

from __future__ import annotations

import os
import time

from pdserve.common.messages import FailStepsTask, LeakBlocksTask
from pdserve.common.request import Request
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core import EngineCore
from pdserve.scheduler.outputs import RemoteKVAllocation

TEST_DELAY_ENV = "PDSERVE_TEST_KV_DELAY_S"


def injected_delay_s(environ: dict[str, str] | None = None) -> float:
    """The test-only pull delay from the environment (0: none); bad values fail loudly."""
    text = (environ if environ is not None else os.environ).get(TEST_DELAY_ENV, "")
    if not text:
        return 0.0
    try:
        delay = float(text)
    except ValueError:
        raise ValueError(f"{TEST_DELAY_ENV} must be a number of seconds, got {text!r}") from None
    if delay < 0:
        raise ValueError(f"{TEST_DELAY_ENV} must be >= 0, got {delay}")
    return delay


class DelayedPulls:
    """Allocations whose pull starts `delay_s` after they were made."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._queue: list[tuple[float, RemoteKVAllocation]] = []

    def add(self, allocation: RemoteKVAllocation, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._queue.append((now + self.delay_s, allocation))

    def pop_due(self, now: float | None = None) -> list[RemoteKVAllocation]:
        now = time.monotonic() if now is None else now
        due = [a for t, a in self._queue if t <= now]
        self._queue = [(t, a) for t, a in self._queue if t > now]
        return due

    def drop(self, request_id: str) -> None:
        self._queue = [(t, a) for t, a in self._queue if a.request_id != request_id]

    def __len__(self) -> int:
        return len(self._queue)


class InjectedStepFailure(RuntimeError):
    """The step failure a `FailStepsTask` asked for."""


class TestHooks:
    __test__ = False  # not a pytest class

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self.kv_delay_s = injected_delay_s(environ)
        self.step_failures = FailStepsTask()

    def fail_steps(self, task: FailStepsTask) -> None:
        self.step_failures = task

    def before_step(self, engine: EngineCore) -> None:
        """Raises InjectedStepFailure where a `FailStepsTask` says this step fails."""
        rule = self.step_failures
        if rule.every_step:
            raise InjectedStepFailure("injected: every step of this instance fails")
        prefix = rule.prompt_prefix
        if prefix and any(
            r.prompt_token_ids[: len(prefix)] == prefix for r in engine.scheduler.requests.values()
        ):
            raise InjectedStepFailure("injected: every step with this request fails")

    def delayed_pulls(self) -> DelayedPulls | None:
        return DelayedPulls(self.kv_delay_s) if self.kv_delay_s > 0 else None

    @staticmethod
    def leak_blocks(engine: EngineCore, task: LeakBlocksTask) -> None:
        block_size = engine.config.block_size
        fake = Request(task.owner, [0] * (block_size * task.num_blocks), SamplingParams())
        engine.scheduler.block_manager.allocate_slots(fake, block_size * task.num_blocks)
