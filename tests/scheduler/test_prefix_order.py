"""The `lpm` admission order (scheduler/prefix_order.py) against first come first served:
the longest cached prefix goes first, a request waits for the blocks a running request is
computing instead of computing them again, and nothing waits forever."""

from __future__ import annotations

import pytest

from pdserve.common.request import RequestStatus
from pdserve.scheduler.config import SchedulerConfig
from pdserve.scheduler.prefix_order import MAX_PASSES
from pdserve.scheduler.step_scheduler import Scheduler
from tests.scheduler.fake_model import FakeModel, make_request, reference_output

BS = 4


def make_scheduler(policy: str, **overrides: object) -> Scheduler:
    settings: dict = dict(
        max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, block_size=BS, num_blocks=128
    )
    settings.update(overrides)
    return Scheduler(SchedulerConfig(scheduling_policy=policy, **settings))


def document(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 997 for i in range(length)]


def chunk_ids(scheduler_output) -> list[str]:
    return [chunk.request.request_id for chunk in scheduler_output.chunks]


def cache_document(sched: Scheduler, model: FakeModel, doc: list[int]) -> None:
    """Runs one request over `doc` to its end, so the document's blocks are cached."""
    sched.add_request(make_request("reader", doc + [1], max_tokens=1))
    model.run_to_completion()


@pytest.mark.parametrize("policy,first", [("lpm", "warm"), ("fcfs", "cold")])
def test_the_longest_cached_prefix_goes_first_under_lpm(policy: str, first: str) -> None:
    sched = make_scheduler(policy)
    model = FakeModel(sched)
    doc = document(1, 28)
    cache_document(sched, model, doc)
    cold = make_request("cold", document(2, 30), max_tokens=2)
    warm = make_request("warm", doc + [5, 6], max_tokens=2)
    sched.add_request(cold)
    sched.add_request(warm)
    output, _ = model.step()
    assert chunk_ids(output)[0] == first
    if policy == "lpm":  # the warm one computes its 2 new tokens, the cold one the rest
        assert [c.num_new_tokens for c in output.chunks] == [2, 30]
    model.run_to_completion()
    for request in (cold, warm):
        assert request.output_token_ids == reference_output(request.prompt_token_ids, 2)
    sched.check_invariants()


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_a_request_waits_for_the_blocks_a_running_request_is_computing(policy: str) -> None:
    """Two prompts over one document arrive together: under lpm the second waits a step
    and finds the first's blocks cached; under fcfs it computes them again beside it."""
    sched = make_scheduler(policy, max_num_batched_tokens=64)
    model = FakeModel(sched)
    doc = document(3, 24)
    sched.add_request(make_request("a", doc + [7, 8], max_tokens=3))
    b_request = make_request("b", doc + [9, 10], max_tokens=3)
    sched.add_request(b_request)
    output, _ = model.step()
    if policy == "lpm":
        assert chunk_ids(output) == ["a"]
        output, _ = model.step()
        b = [c for c in output.chunks if c.request.request_id == "b"][0]
        assert b.start == 24 and b.num_new_tokens == 2  # the document came from the cache
    else:
        assert chunk_ids(output) == ["a", "b"] and output.chunks[1].num_new_tokens == 26
    model.run_to_completion()
    assert b_request.output_token_ids == reference_output(doc + [9, 10], 3)
    sched.check_invariants()


def test_a_request_passed_over_often_enough_goes_first() -> None:
    """A cold prompt behind a stream of cached ones is passed over at most MAX_PASSES
    times, then admitted before them."""
    sched = make_scheduler("lpm", max_num_batched_tokens=8, max_num_seqs=1)
    model = FakeModel(sched)
    doc = document(4, 24)
    cache_document(sched, model, doc)
    cold = make_request("cold", document(5, 40), max_tokens=1)
    sched.add_request(cold)
    admitted_before_cold = 0
    for i in range(4 * MAX_PASSES):
        sched.add_request(make_request(f"warm{i}", doc + [i % 50 + 1], max_tokens=1))
        output, _ = model.step()
        if "cold" in chunk_ids(output):
            break
        admitted_before_cold += sum(1 for rid in chunk_ids(output) if rid.startswith("warm"))
    else:
        pytest.fail("the cold request was never admitted")
    assert admitted_before_cold == MAX_PASSES
    model.run_to_completion()
    assert cold.output_token_ids == reference_output(document(5, 40), 1)
    sched.check_invariants()


def test_preempted_requests_keep_the_front_under_lpm() -> None:
    sched = make_scheduler("lpm", num_blocks=6, max_num_batched_tokens=64)
    model = FakeModel(sched)
    for seed, rid in enumerate(("old", "mid", "new"), start=1):
        sched.add_request(make_request(rid, document(seed, 8), max_tokens=8))
    model.step()
    output, _ = model.step()
    assert output.preempted_ids == ["new"]
    newest = sched.get_request("new")
    assert newest is not None and newest.status is RequestStatus.PREEMPTED
    assert sched.waiting[0] is newest
    model.run_to_completion()
    assert newest.output_token_ids == reference_output(document(3, 8), 8)


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, lpm"):
        make_scheduler("sjf")
