"""The timestamps behind vLLM's queue / prefill / decode histograms: when a request is
queued, first scheduled, gets its first and last token, and the phase times each
instance kind reports when the request leaves it."""

from __future__ import annotations

from pdserve.common.request import PhaseTimes, Request, RequestStatus
from pdserve.scheduler.step_scheduler import Scheduler
from tests.scheduler.fake_model import FakeModel, make_request
from tests.scheduler.test_step_scheduler import make_scheduler, prompt_of


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed_scheduler(**overrides: object) -> tuple[Scheduler, FakeModel, Clock]:
    sched = make_scheduler(**overrides)
    clock = Clock()
    sched.clock = clock
    return sched, FakeModel(sched), clock


def step_at(sched: Scheduler, model: FakeModel, clock: Clock, scheduled: float, done: float):
    """One step whose schedule() runs at `scheduled` and whose tokens come at `done`."""
    clock.now = scheduled
    output = sched.schedule()
    clock.now = done
    return sched.update_from_output(output, model.execute(output))


def test_colocated_request_reports_queue_prefill_and_decode() -> None:
    sched, model, clock = timed_scheduler()
    clock.now = 1.0
    req = make_request("a", prompt_of(10), max_tokens=3)
    sched.add_request(req)
    step_at(sched, model, clock, 3.0, 4.0)  # the whole prompt, first token
    assert (req.queued_time, req.first_scheduled_time, req.first_token_time) == (1.0, 3.0, 4.0)
    step_at(sched, model, clock, 4.5, 5.0)
    assert sched.take_phase_times() == []  # still running
    step_at(sched, model, clock, 6.5, 7.0)
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.last_token_time == 7.0
    assert sched.take_phase_times() == [PhaseTimes(queue=2.0, prefill=1.0, decode=3.0)]
    assert sched.take_phase_times() == []  # taken once


def test_chunked_and_preempted_requests_keep_their_first_scheduling() -> None:
    sched, model, clock = timed_scheduler(max_num_batched_tokens=8)
    req = make_request("a", prompt_of(12), max_tokens=1)
    sched.add_request(req)
    step_at(sched, model, clock, 2.0, 3.0)  # 8 of 12 prompt tokens, no token yet
    assert req.first_token_time is None
    # Preempted and admitted again later: its first scheduling stays the first.
    sched.running.remove(req)
    sched._preempt(req, sched.schedule())
    step_at(sched, model, clock, 5.0, 6.0)  # 8 tokens from the prefix cache, 4 computed
    assert req.is_finished
    assert sched.take_phase_times() == [PhaseTimes(queue=2.0, prefill=4.0, decode=0.0)]


def test_prefill_side_reports_queue_and_prefill_when_it_hands_off() -> None:
    sched, model, clock = timed_scheduler()
    clock.now = 1.0
    sched.add_request(make_request("p", prompt_of(10), max_tokens=5), hand_off=True)
    [left] = step_at(sched, model, clock, 2.0, 2.5)
    assert left.status is RequestStatus.HANDED_OFF
    assert sched.take_phase_times() == [PhaseTimes(queue=1.0, prefill=0.5)]
    sched.abort_request("p")  # ended meanwhile: reported once, when it was handed off
    assert sched.take_phase_times() == []
    assert sched.release_held_blocks("p")


def handed_off(prompt: list[int]) -> Request:
    req = make_request("r", prompt, max_tokens=3)
    req.output_token_ids = [7]  # P's first token
    return req


def test_decode_side_reports_decode_from_the_handoffs_arrival() -> None:
    sched, model, clock = timed_scheduler()
    clock.now = 10.0
    req = handed_off(prompt_of(10))
    sched.add_remote_request(req, 10)
    clock.now = 10.5
    [allocation] = sched.schedule().remote_kv_allocations  # blocks allocated: the pull starts
    assert req.first_scheduled_time == 10.5
    model.fill_remote(allocation.block_ids, req, 0, 10)
    assert sched.finish_remote_kvs("r", success=True)
    step_at(sched, model, clock, 11.0, 11.5)
    step_at(sched, model, clock, 12.0, 12.5)
    assert req.is_finished
    assert sched.take_phase_times() == [PhaseTimes(decode=2.5)]


def test_an_abort_reports_what_ran_and_a_never_scheduled_request_nothing() -> None:
    sched, model, clock = timed_scheduler()
    sched.add_request(make_request("a", prompt_of(10), max_tokens=50))
    step_at(sched, model, clock, 1.0, 2.0)
    step_at(sched, model, clock, 3.0, 4.0)
    clock.now = 9.0
    assert sched.abort_request("a")  # e.g. a stop string matched at the gateway
    sched.add_request(make_request("b", prompt_of(10, 1)))
    assert sched.abort_request("b")
    assert sched.take_phase_times() == [
        PhaseTimes(queue=1.0, prefill=1.0, decode=2.0),
        PhaseTimes(),
    ]
