"""The step scheduler: budgets, chunked prefill, mixed steps, preemption, stops, aborts."""

from __future__ import annotations

import pytest

from pdserve.common.request import Request, RequestStatus
from pdserve.scheduler.config import SchedulerConfig
from pdserve.scheduler.step_scheduler import Scheduler
from tests.scheduler.fake_model import FakeModel, make_request, reference_output


def make_scheduler(**overrides: object) -> Scheduler:
    settings: dict = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=4, num_blocks=128
    )
    settings.update(overrides)
    return Scheduler(SchedulerConfig(**settings))


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 997 for i in range(length)]


def with_request(
    prompt_len: int, scheduler: dict | None = None, **request_args: object
) -> tuple[Scheduler, FakeModel, Request]:
    """A scheduler (`make_scheduler(**scheduler)`), its model, and request "a" of a
    prompt_of(prompt_len) added to it."""
    sched = make_scheduler(**(scheduler or {}))
    req = make_request("a", prompt_of(prompt_len), **request_args)  # type: ignore[arg-type]
    sched.add_request(req)
    return sched, FakeModel(sched), req


def test_a_request_prefills_then_decodes_to_max_tokens() -> None:
    sched, model, req = with_request(10, max_tokens=5)
    first = sched.schedule()
    assert [(c.request.request_id, c.start, c.num_new_tokens) for c in first.chunks] == [
        ("a", 0, 10)
    ]
    assert first.chunks[0].samples and req.status is RequestStatus.RUNNING
    sched.update_from_output(first, model.execute(first))
    outputs = model.run_to_completion()
    assert [c.num_new_tokens for o in outputs for c in o.chunks] == [1, 1, 1, 1]
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.output_token_ids == reference_output(req.prompt_token_ids, 5)
    assert outputs[-1].finished_ids == []
    assert sched.schedule().finished_ids == ["a"]  # the step after it finished says so
    sched.check_invariants()
    assert sched.block_manager.num_free_blocks == 128


def test_finished_ids_arrive_with_the_next_schedule() -> None:
    sched = make_scheduler()
    model = FakeModel(sched)
    sched.add_request(make_request("a", prompt_of(5), max_tokens=1))
    sched.add_request(make_request("b", prompt_of(5, 1), max_tokens=3))
    _, left = model.step()
    assert [r.request_id for r in left] == ["a"]
    assert sched.schedule().finished_ids == ["a"]


def test_chunked_prefill_splits_a_long_prompt_across_steps() -> None:
    sched, model, req = with_request(20, {"max_num_batched_tokens": 8}, max_tokens=2)
    chunks = []
    for _ in range(3):
        output = sched.schedule()
        chunks += [(c.start, c.num_new_tokens, c.samples) for c in output.chunks]
        sched.update_from_output(output, model.execute(output))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert req.num_output_tokens == 1 and req.num_computed_tokens == 20
    model.run_to_completion()
    assert req.output_token_ids == reference_output(req.prompt_token_ids, 2)


def test_a_step_mixes_prefill_chunks_with_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    model = FakeModel(sched)
    sched.add_request(make_request("short1", prompt_of(6, 1), max_tokens=10))
    sched.add_request(make_request("short2", prompt_of(6, 2), max_tokens=10))
    model.step()
    sched.add_request(make_request("long", prompt_of(40, 3), max_tokens=3))
    output, _ = model.step()
    kinds = {c.request.request_id: (c.num_new_tokens, c.start) for c in output.chunks}
    assert kinds == {"short1": (1, 6), "short2": (1, 6), "long": (14, 0)}
    assert output.num_tokens == 16
    assert model.mixed_steps == 1
    model.run_to_completion()
    for rid in ("short1", "short2", "long"):
        assert sched.get_request(rid) is None


def test_running_requests_come_first_and_the_budget_holds() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    model = FakeModel(sched)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", prompt_of(7, i), max_tokens=6))
    outputs = model.run_to_completion()
    assert all(o.num_tokens <= 10 for o in outputs)
    first = [(c.request.request_id, c.num_new_tokens) for c in outputs[0].chunks]
    assert first == [("r0", 7), ("r1", 3)]
    second = [(c.request.request_id, c.num_new_tokens) for c in outputs[1].chunks]
    assert second == [("r0", 1), ("r1", 4), ("r2", 5)], "running first, then FCFS"
    assert model.tokens_computed == 4 * 7 + 4 * 5


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_scheduler(max_num_seqs=2)
    model = FakeModel(sched)
    reqs = [make_request(f"r{i}", prompt_of(5, i), max_tokens=3 + i) for i in range(4)]
    for req in reqs:
        sched.add_request(req)
    outputs = model.run_to_completion()
    assert max(len(o.chunks) for o in outputs) == 2
    assert [c.request.request_id for c in outputs[0].chunks] == ["r0", "r1"]
    admitted_r2 = next(i for i, o in enumerate(outputs) if "r2" in o_ids(o))
    assert reqs[0].status.finished and admitted_r2 == 3  # r0 finished at step 3 (0-based 2)
    for req in reqs:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.num_output_tokens)


def o_ids(output) -> set[str]:
    return {c.request.request_id for c in output.chunks}


def test_without_chunked_prefill_whole_prompts_wait_for_room() -> None:
    sched = make_scheduler(
        enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=32
    )
    model = FakeModel(sched)
    sched.add_request(make_request("a", prompt_of(20), max_tokens=4))
    sched.add_request(make_request("b", prompt_of(20, 1), max_tokens=4))
    output, _ = model.step()
    assert [(c.request.request_id, c.num_new_tokens) for c in output.chunks] == [("a", 20)]
    output, _ = model.step()
    assert [(c.request.request_id, c.num_new_tokens) for c in output.chunks] == [
        ("a", 1),
        ("b", 20),
    ]


def test_a_prefix_hit_computes_only_the_uncached_tokens() -> None:
    sched = make_scheduler()
    model = FakeModel(sched)
    system = prompt_of(24, 9)  # six full blocks
    first = make_request("first", system + [1, 2, 3], max_tokens=4)
    sched.add_request(first)
    model.run_to_completion()
    computed_before = model.tokens_computed
    second = make_request("second", system + [4, 5, 6, 7, 8], max_tokens=4)
    sched.add_request(second)
    output, _ = model.step()
    assert (output.chunks[0].start, output.chunks[0].num_new_tokens) == (24, 5)
    assert second.num_cached_tokens == 24
    model.run_to_completion()
    assert model.tokens_computed - computed_before == 29 - 24 + 3
    assert second.output_token_ids == reference_output(second.prompt_token_ids, 4)
    stats = sched.stats()
    assert stats.prefix_cache_queries_total == 27 + 29
    assert stats.prefix_cache_hits_total == 24


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    sched = make_scheduler()
    model = FakeModel(sched)
    prompt = prompt_of(16, 4)
    sched.add_request(make_request("a", prompt, max_tokens=2))
    model.run_to_completion()
    twin = make_request("b", prompt, max_tokens=2)
    sched.add_request(twin)
    output, _ = model.step()
    assert (output.chunks[0].start, output.chunks[0].num_new_tokens) == (12, 4)
    model.run_to_completion()
    assert twin.output_token_ids == reference_output(prompt, 2)


def test_salted_requests_do_not_hit_each_others_cache() -> None:
    sched = make_scheduler()
    model = FakeModel(sched)
    prompt = prompt_of(20, 5)
    sched.add_request(make_request("a", prompt, max_tokens=1, salt="tenant-a"))
    model.run_to_completion()
    sched.add_request(make_request("b", prompt, max_tokens=1, salt="tenant-b"))
    output, _ = model.step()
    assert output.chunks[0].start == 0


def run_workload(num_blocks: int, max_batched: int = 32) -> tuple[Scheduler, FakeModel, list]:
    sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=max_batched)
    model = FakeModel(sched)
    reqs = [make_request(f"r{i}", prompt_of(9 + 3 * i, i), max_tokens=20) for i in range(5)]
    for req in reqs:
        sched.add_request(req)
    model.run_to_completion()
    return sched, model, reqs


def test_preemption_recomputes_to_identical_outputs() -> None:
    roomy, _, expected = run_workload(num_blocks=128)
    tight, _, got = run_workload(num_blocks=16)
    assert roomy.num_preemptions_total == 0
    assert tight.num_preemptions_total > 0
    assert tight.stats().num_preemptions_total == tight.num_preemptions_total
    assert sum(r.num_preemptions for r in got) == tight.num_preemptions_total
    for want, have in zip(expected, got, strict=True):
        assert have.output_token_ids == want.output_token_ids
        assert have.output_token_ids == reference_output(have.prompt_token_ids, 20)
    tight.check_invariants()
    assert tight.block_manager.num_free_blocks == 16


def test_preemption_takes_the_most_recently_admitted_request() -> None:
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    model = FakeModel(sched)
    for seed, rid in enumerate(("old", "mid", "new"), start=1):
        sched.add_request(make_request(rid, prompt_of(8, seed), max_tokens=8))
    output, _ = model.step()  # three prompts of two blocks each fill the pool
    assert sched.block_manager.num_free_blocks == 0 and output.num_tokens == 24
    newest = sched.get_request("new")
    assert newest is not None and newest.num_output_tokens == 1
    output, _ = model.step()  # everyone needs a third block: "new" goes, "mid" gets its blocks
    assert output.preempted_ids == ["new"]
    assert newest.status is RequestStatus.PREEMPTED and newest.num_computed_tokens == 0
    assert newest.num_preemptions == 1 and newest.num_output_tokens == 1
    assert sched.waiting[0] is newest
    assert o_ids(output) == {"old", "mid"}
    model.run_to_completion()
    assert newest.output_token_ids == reference_output(newest.prompt_token_ids, 8)


def test_the_last_running_request_preempts_itself() -> None:
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    model = FakeModel(sched)
    a = make_request("a", prompt_of(7, 1), max_tokens=6)  # its 8th token still fits
    b = make_request("b", prompt_of(8, 2), max_tokens=6)  # its 9th token needs a 3rd block
    sched.add_request(a)
    sched.add_request(b)
    model.step()
    output, _ = model.step()
    assert output.preempted_ids == ["b"]
    assert [(c.request.request_id, c.start) for c in output.chunks] == [("a", 7)]
    assert b.status is RequestStatus.PREEMPTED and sched.waiting[0] is b
    model.run_to_completion()
    assert a.output_token_ids == reference_output(a.prompt_token_ids, 6)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 6)
    sched.check_invariants()


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    model = FakeModel(sched)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, prompt_of(8, ord(rid)), max_tokens=8))
    model.step()
    sched.add_request(make_request("late", [1], max_tokens=1))
    output, _ = model.step()
    assert output.preempted_ids == ["c"] and "late" not in o_ids(output)
    assert [r.request_id for r in sched.waiting] == ["c", "late"], "the preempted go first"


# ---- stop conditions ------------------------------------------------------------


def run_with_tokens(tokens: list[int], **request_args: object):
    """Runs one request whose sampled tokens are `tokens` in order."""
    sched, model, req = with_request(5, **request_args)
    feed = iter(tokens)
    for _ in range(len(tokens)):
        output = sched.schedule()
        sched.update_from_output(output, model.execute(output, lambda r, c: next(feed)))
        if req.is_finished:
            break
    sched.check_invariants()
    return req, sched


def test_eos_stops_the_request() -> None:
    req, sched = run_with_tokens([5, 6, 2, 7], eos=frozenset({2}))
    assert req.output_token_ids == [5, 6, 2]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason is None
    assert req.status.finish_reason == "stop"
    assert not sched.has_unfinished_requests()


def test_ignore_eos_keeps_going() -> None:
    req, _ = run_with_tokens([2, 2, 2], eos=frozenset({2}), ignore_eos=True, max_tokens=3)
    assert req.output_token_ids == [2, 2, 2]
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_min_tokens_holds_back_eos_and_stop_tokens() -> None:
    req, _ = run_with_tokens(
        [2, 9, 4, 2], eos=frozenset({2}), stop_token_ids=[9], min_tokens=3, max_tokens=10
    )
    assert req.output_token_ids == [2, 9, 4, 2]
    assert req.status is RequestStatus.FINISHED_STOPPED


def test_stop_token_id_sets_the_stop_reason() -> None:
    req, _ = run_with_tokens([4, 9, 5], stop_token_ids=[9])
    assert req.output_token_ids == [4, 9]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == 9


def test_max_tokens_caps_the_length() -> None:
    req, _ = run_with_tokens([4, 5, 6, 7], max_tokens=2)
    assert req.output_token_ids == [4, 5]
    assert req.status.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt_len", "outputs"),
    [(9, 3), (12, 1)],
    ids=["caps-the-length", "a-prompt-of-exactly-max-model-len-gets-one-token"],
)
def test_max_model_len(prompt_len: int, outputs: int) -> None:
    sched, model, req = with_request(prompt_len, {"max_model_len": 12}, max_tokens=None)
    model.run_to_completion()
    assert req.num_output_tokens == outputs and req.num_tokens == prompt_len + outputs
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED


# ---- ending requests from outside -----------------------------------------------


def test_abort_a_waiting_request() -> None:
    sched = make_scheduler()
    req = make_request("a", prompt_of(5))
    sched.add_request(req)
    assert sched.abort_request("a")
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_ids == ["a"]
    assert not sched.abort_request("a"), "aborting twice is a no-op"


def test_abort_between_schedule_and_update_skips_the_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    model = FakeModel(sched)
    doomed = make_request("doomed", prompt_of(20), max_tokens=4)
    other = make_request("other", prompt_of(3, 1), max_tokens=4)
    sched.add_request(doomed)
    sched.add_request(other)
    model.step()
    output = sched.schedule()
    sampled = model.execute(output)
    assert sched.abort_request("doomed")
    sched.check_invariants()
    assert "doomed" not in sched.block_manager.holder_ids()
    sched.update_from_output(output, sampled)
    assert doomed.num_computed_tokens == 8 and doomed.status is RequestStatus.FINISHED_ABORTED
    assert sched.schedule().finished_ids == ["doomed"]
    model.run_to_completion()
    assert other.output_token_ids == reference_output(other.prompt_token_ids, 4)


def test_finish_request_ends_a_running_request_as_stopped() -> None:
    sched, model, req = with_request(5, max_tokens=10)
    model.step()
    assert sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert req.status.finish_reason == "stop"
    assert sched.block_manager.num_free_blocks == 128
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_request("a", RequestStatus.RUNNING)


def test_update_rejects_a_missing_token_and_a_replayed_output() -> None:
    sched = make_scheduler()
    model = FakeModel(sched)
    sched.add_request(make_request("a", prompt_of(5), max_tokens=4))
    output = sched.schedule()
    with pytest.raises(ValueError, match="no token came back"):
        sched.update_from_output(output, {})
    sched2 = make_scheduler()
    model = FakeModel(sched2)
    sched2.add_request(make_request("a", prompt_of(5), max_tokens=4))
    output = sched2.schedule()
    sampled = model.execute(output)
    sched2.update_from_output(output, sampled)
    with pytest.raises(ValueError, match="applied twice"):
        sched2.update_from_output(output, sampled)


# ---- validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message"),
    [
        ([], 4, "prompt is empty"),
        (list(range(257)), 4, "exceed max_model_len"),
        (list(range(200)), 40, "more than the pool"),
    ],
)
def test_bad_requests_are_rejected_with_one_line(prompt, max_tokens, message) -> None:
    sched = make_scheduler(num_blocks=50)  # 200 tokens
    with pytest.raises(ValueError, match=message) as info:
        sched.add_request(make_request("x", prompt, max_tokens=max_tokens))
    assert "\n" not in str(info.value)
    assert not sched.has_unfinished_requests() and sched.get_request("x") is None


def test_unbounded_max_tokens_counts_up_to_max_model_len() -> None:
    sched = make_scheduler(num_blocks=50, max_model_len=256)
    with pytest.raises(ValueError, match="more than the pool"):
        sched.add_request(make_request("x", [1, 2, 3], max_tokens=None))
    sched.add_request(make_request("y", [1, 2, 3], max_tokens=190))


def test_duplicate_request_ids_are_rejected() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add_request(make_request("a", [3, 4]))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_blocks", 0, "num_blocks"),
        ("max_num_seqs", 0, "max_num_seqs"),
        ("block_size", 0, "block_size"),
        ("enable_chunked_prefill", False, "without chunked prefill"),
    ],
)
def test_bad_configs_are_rejected(field: str, value: object, message: str) -> None:
    settings: dict = dict(max_num_batched_tokens=64, max_model_len=256, num_blocks=8)
    settings[field] = value
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**settings)


def test_stats_describe_the_queues_and_the_cache() -> None:
    sched = make_scheduler(max_num_seqs=1, num_blocks=10)
    model = FakeModel(sched)
    sched.add_request(make_request("a", prompt_of(8), max_tokens=3))
    sched.add_request(make_request("b", prompt_of(8, 1), max_tokens=3))
    model.step()
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_waiting_for_remote_kvs) == (1, 1, 0)
    assert stats.kv_cache_usage_perc == pytest.approx(0.2)  # 8 computed → 2 blocks of 10
    model.run_to_completion()
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.kv_cache_usage_perc == 0.0


def test_check_invariants_catches_a_request_in_the_wrong_queue() -> None:
    sched, model, req = with_request(5, max_tokens=4)
    model.step()
    req.status = RequestStatus.WAITING
    with pytest.raises(AssertionError, match="running request a has status WAITING"):
        sched.check_invariants()
    req.status = RequestStatus.RUNNING
    sched.check_invariants()
    sched.waiting.append(req)  # now in two queues at once
    with pytest.raises(AssertionError, match="waiting request a"):
        sched.check_invariants()
