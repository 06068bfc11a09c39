"""An instance's side of a request's trace, on the step loop with a fake executor: the
queue starts when the I/O thread received the task, and with model detail on each
request is charged the model time of the steps it was part of (its prefill apart from
each decode stretch), inside the span its own timestamps bound."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pdserve.common.messages import InstanceTimings, ModelTime
from pdserve.common.request import Request
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from tests.instance.test_step_loop import Harness, generate

STEP_S = 0.02  # each fake step with chunks; half of it is reported as its forward


@pytest.fixture
def plain() -> Iterator[Harness]:
    harness = Harness("colocated")
    yield harness
    harness.close()


@pytest.fixture
def timed() -> Iterator[Harness]:
    # A budget of 4 tokens a step: a 7-token prompt takes two prefill steps.
    config = EngineConfig(block_size=4, max_num_batched_tokens=4, collect_model_time=True)
    harness = Harness("colocated", engine=config)
    harness.executor.step_s = STEP_S
    yield harness
    harness.close()


def reported(harness: Harness, request_id: str) -> InstanceTimings:
    [timings] = [d.timings for d in harness.deltas if d.request_id == request_id and d.timings]
    return timings


def test_the_queue_starts_when_the_task_was_received_not_when_the_loop_took_it(plain) -> None:
    sent = time.time()
    plain.send(generate("a", [5, 6, 7], max_tokens=2))
    time.sleep(0.3)  # as if a long step ran: the task waits in the I/O thread's inbox
    taken = time.time()
    plain.until(lambda: plain.finished("a"), "finished request")
    timings = reported(plain, "a")
    assert sent - 1e-3 <= timings.queued < taken - 0.2
    assert timings.first_scheduled is not None and timings.first_scheduled >= taken


def test_without_model_detail_nothing_is_charged(plain) -> None:
    plain.send(generate("a", [5, 6, 7], max_tokens=3))
    plain.until(lambda: plain.finished("a"), "finished request")
    timings = reported(plain, "a")
    assert timings.prefill_model is None and timings.decode_model == []


def test_each_request_is_charged_the_steps_it_was_part_of(timed) -> None:
    timed.send(generate("a", [5, 6, 7, 8, 9, 10, 11], max_tokens=4))
    timed.until(lambda: timed.finished("a"), "finished request")
    t = reported(timed, "a")
    assert t.first_scheduled and t.first_token and t.last_token
    prefill, [decode] = t.prefill_model, t.decode_model
    assert prefill is not None and prefill.forward is not None and decode.forward is not None
    assert prefill.forward == pytest.approx(2 * STEP_S / 2)  # two chunks of the prompt
    assert 2 * STEP_S <= prefill.execute <= t.first_token - t.first_scheduled
    assert decode.forward == pytest.approx(3 * STEP_S / 2)  # three tokens after the first
    assert 3 * STEP_S <= decode.execute <= t.last_token - t.first_token


def test_requests_sharing_a_step_are_each_charged_all_of_it(timed) -> None:
    timed.send(generate("a", [5, 6], max_tokens=3))
    timed.send(generate("b", [7, 8], max_tokens=3))
    time.sleep(0.1)  # both in the inbox before the first turn: they share every step
    timed.until(lambda: timed.finished("a") and timed.finished("b"), "finished requests")
    assert len([plan for _, plan in timed.executor.plans if plan.chunks]) == 3
    a, b = reported(timed, "a"), reported(timed, "b")
    assert a.prefill_model is not None and b.prefill_model is not None
    assert a.prefill_model.forward == b.prefill_model.forward == pytest.approx(STEP_S / 2)
    assert [m.forward for m in a.decode_model] == pytest.approx([2 * STEP_S / 2])
    assert [m.forward for m in b.decode_model] == pytest.approx([2 * STEP_S / 2])


def test_decode_stretches_split_where_it_was_preempted() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8))
    request.queued_time = 0.0
    request.preempted_times.append(0.5)  # before its first token: still its prefill
    request.add_model_time(request.prefills_here, 0.1, 0.2)
    request.first_token_time = 1.0
    assert not request.prefills_here
    request.add_model_time(request.prefills_here, 0.1, 0.2)
    request.preempted_times.append(2.0)
    request.add_model_time(request.prefills_here, 0.3, 0.4)
    request.add_model_time(request.prefills_here, None, 0.1)  # a forward not timed
    timings = request.timings()
    assert timings is not None
    assert timings.prefill_model == ModelTime(0.1, 0.2)
    assert timings.decode_model == [ModelTime(0.1, 0.2), ModelTime(None, 0.5)]


def test_a_handed_off_request_decodes_from_its_first_step_here() -> None:
    handed = Request("h", [1, 2, 3], SamplingParams(), output_token_ids=[4])
    handed.prefilled_elsewhere = True
    handed.preempted_times.append(0.5)  # every preemption here splits its decode
    handed.add_model_time(handed.prefills_here, 0.1, 0.2)
    assert handed.prefill_model is None and handed.decode_model == [
        ModelTime(),
        ModelTime(0.1, 0.2),
    ]
