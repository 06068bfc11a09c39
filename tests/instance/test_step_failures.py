"""A failed step on the step loop (fake executor, no model): its requests are dropped
and handed back to the gateway to move on; steps that keep failing trip the circuit
breaker (the instance says it is unhealthy); requests that failed a step elsewhere run
one at a time, and the one on trial is blamed for a failed step, which then does not
count toward the breaker."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.common.messages import (
    STEP_BYSTANDER,
    STEP_SUSPECT,
    FailStepsTask,
    RequestDelta,
)
from pdserve.engine.step_plan import StepPlan, StepResult
from pdserve.instance.breaker import MAX_FAILED_STEPS, StepBreaker
from pdserve.instance.probation import Probation
from tests.instance.test_step_loop import FakeExecutor, Harness, generate


class BrokenExecutor(FakeExecutor):
    """A device that fails every step once `broken` (a sticky CUDA error)."""

    broken = False

    def execute(self, plan: StepPlan) -> StepResult:
        if self.broken and plan.chunks:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().execute(plan)


def harness(test_hooks: bool = False) -> Harness:
    found = Harness("colocated", test_hooks=test_hooks)
    found.loop.executor = found.executor = BrokenExecutor()
    found.loop.require_engine().executor = found.executor
    return found


def last(h: Harness, request_id: str) -> RequestDelta:
    return [d for d in h.deltas if d.request_id == request_id][-1]


def test_steps_that_keep_failing_trip_the_breaker() -> None:
    h = harness()
    try:
        h.executor.broken = True
        for index in range(MAX_FAILED_STEPS):
            assert h.unhealthy == ""
            h.send(generate(f"r{index}", [5, 6, 7]))
            h.until(lambda i=index: h.finished(f"r{i}"), "the failed step")
            delta = last(h, f"r{index}")
            # Not an error for the client: handed back to be sent elsewhere.
            assert delta.step_failed == STEP_SUSPECT and "illegal memory access" in delta.error
        h.turn()
        assert "its last 3 steps failed" in h.unhealthy and "CUDA error" in h.unhealthy
        assert h.loop.io.unhealthy == h.unhealthy  # heartbeats say it too
    finally:
        h.close()


def test_a_successful_step_resets_the_breaker() -> None:
    h = harness()
    try:
        for index in range(2 * MAX_FAILED_STEPS):
            h.executor.broken = index % MAX_FAILED_STEPS != 0  # one good step in each run
            h.send(generate(f"r{index}", [5, 6, 7], max_tokens=1))
            h.until(lambda i=index: h.finished(f"r{i}"), "the step")
        h.turn()
        assert h.unhealthy == ""
    finally:
        h.close()


def test_requests_on_probation_run_one_at_a_time_and_the_one_on_trial_is_blamed() -> None:
    h = harness(test_hooks=True)
    try:
        poison, innocent = [40, 41, 42], [50, 51, 52]
        h.send(FailStepsTask(prompt_prefix=poison))
        h.send(generate("healthy", [5, 6, 7], max_tokens=8))
        h.turn(2)
        h.send(msgspec.structs.replace(generate("bad", poison), step_failures=1))
        h.send(msgspec.structs.replace(generate("good", innocent), step_failures=1))
        h.until(lambda: h.finished("bad"), "the poison request's end")
        bad = last(h, "bad")
        assert bad.finish_reason == "error" and bad.step_failed == ""  # ends: not moved on
        assert "every step with this request fails" in bad.error
        # The healthy request of the failed step moves on without a strike.
        assert last(h, "healthy").step_failed == STEP_BYSTANDER
        # "good" waited out of the scheduler, then ran alone on trial and finished.
        h.until(lambda: h.finished("good"), "the innocent one")
        assert last(h, "good").finish_reason == "length" and h.tokens("good") == [53, 54, 55, 56]
        assert h.loop.breaker.failed_in_a_row == 0 and h.unhealthy == ""
    finally:
        h.close()


@pytest.mark.parametrize("hooks", [True, False])
def test_the_step_failure_hook_acts_only_with_test_hooks(hooks: bool) -> None:
    h = harness(test_hooks=hooks)
    try:
        h.send(FailStepsTask(every_step=True))
        h.send(generate("a", [5, 6, 7], max_tokens=2))
        h.until(lambda: h.finished("a"), "the request's end")
        assert (last(h, "a").step_failed == STEP_SUSPECT) is hooks
    finally:
        h.close()


def test_the_breaker_counts_failures_in_a_row_and_seconds_of_them() -> None:
    now = [0.0]
    breaker = StepBreaker(max_failed_steps=3, max_failing_s=5.0, clock=lambda: now[0])
    assert breaker.record_failure("x") == "" and breaker.record_failure("x") == ""
    breaker.record_success()
    assert breaker.record_failure("x") == ""
    now[0] = 6.0
    assert "its last 2 steps failed (6.0 s)" in breaker.record_failure("boom")
    breaker.record_success()
    assert breaker.tripped  # it stays tripped: the instance is replaced


def test_probation_admits_one_on_trial_and_drops_aborted_ones() -> None:
    probation = Probation()
    clean = generate("clean", [1])
    suspects = [msgspec.structs.replace(generate(i, [1]), step_failures=1) for i in "abc"]
    assert probation.admit(clean)
    assert [probation.admit(t) for t in suspects] == [True, False, False]
    assert probation.on_trial == "a" and len(probation) == 3
    probation.drop(["b"])
    assert probation.blame() == "a"

    class Scheduler:
        requests: dict = {}

    assert [t.request_id for t in probation.clear(Scheduler())] == ["c"]
    assert probation.on_trial == "c"
