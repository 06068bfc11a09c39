"""Disaggregation hooks: prefill-side hand-off with held blocks, decode-side remote KV."""

from __future__ import annotations

import pytest

from pdserve.common.request import Request, RequestStatus
from pdserve.scheduler.config import SchedulerConfig
from pdserve.scheduler.step_scheduler import Scheduler
from tests.scheduler.fake_model import FakeModel, make_request, next_token, reference_output

BS = 4


def make_scheduler(**overrides: object) -> Scheduler:
    settings: dict = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=BS, num_blocks=64
    )
    settings.update(overrides)
    return Scheduler(SchedulerConfig(**settings))


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 997 for i in range(length)]


def handed_off(prompt: list[int], rid: str = "r", max_tokens: int = 6, salt: str = "") -> Request:
    """The request as a decode instance receives it: the prompt plus P's first token."""
    req = make_request(rid, prompt, max_tokens=max_tokens, salt=salt)
    req.output_token_ids.append(next_token(list(prompt), 1000))
    return req


# ---- prefill side ---------------------------------------------------------------


def test_hand_off_holds_the_blocks_after_the_first_token() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    model = FakeModel(sched)
    req = make_request("p", prompt_of(14), max_tokens=10)
    sched.add_request(req, hand_off=True)
    left: list[Request] = []
    while sched.has_unfinished_requests():
        left += model.step()[1]
    assert left == [req] and req.status is RequestStatus.HANDED_OFF
    assert not req.is_finished and req.status.finish_reason is None
    assert req.output_token_ids == [next_token(prompt_of(14), 1000)]
    held = sched.get_block_ids("p")
    assert len(held) == 4 and sched.held == {"p": req}
    assert sched.block_manager.num_free_blocks == 60, "held blocks are neither free nor evictable"
    assert sched.stats().num_held == 1 and sched.stats().num_running == 0
    assert sched.schedule().finished_ids == ["p"]
    sched.check_invariants()
    # the KV is still where the decode side will read it
    assert model.read(held, 14) == req.prompt_token_ids
    assert sched.release_held_blocks("p")
    assert not sched.release_held_blocks("p")
    assert sched.get_request("p") is None
    assert sched.block_manager.num_free_blocks == 64
    assert sched.block_manager.pool.num_cached_blocks == 3  # 14 tokens: three full blocks
    sched.check_invariants()


def test_a_first_token_that_finishes_the_request_is_not_handed_off() -> None:
    sched = make_scheduler()
    model = FakeModel(sched)
    short = make_request("one", prompt_of(6), max_tokens=1)
    eos = make_request("eos", prompt_of(6, 1), max_tokens=5, eos=frozenset({7}))
    sched.add_request(short, hand_off=True)
    sched.add_request(eos, hand_off=True)
    output = sched.schedule()
    left = sched.update_from_output(output, model.execute(output, lambda r, c: 7))
    assert {r.request_id: r.status for r in left} == {
        "one": RequestStatus.FINISHED_LENGTH_CAPPED,
        "eos": RequestStatus.FINISHED_STOPPED,
    }
    assert sched.held == {} and sched.block_manager.num_free_blocks == 64
    sched.check_invariants()


def test_aborting_a_held_request_keeps_its_blocks_until_the_transfer_ends() -> None:
    sched = make_scheduler()
    model = FakeModel(sched)
    req = make_request("p", prompt_of(9), max_tokens=4)
    sched.add_request(req, hand_off=True)
    model.step()
    assert req.status is RequestStatus.HANDED_OFF
    assert sched.abort_request("p")
    assert req.status is RequestStatus.FINISHED_ABORTED and sched.get_request("p") is None
    assert sched.held == {} and sched.quarantined == {"p": req}
    assert sched.block_manager.num_free_blocks == 61, "the decode side may still read them"
    assert sched.schedule().finished_ids == ["p"], "reported once, for its hand-off"
    sched.check_invariants()
    assert sched.release_held_blocks("p")
    assert sched.block_manager.num_free_blocks == 64 and sched.quarantined == {}
    assert not sched.release_held_blocks("p")
    sched.check_invariants()


def test_a_hand_off_request_needs_blocks_for_its_prompt_only() -> None:
    sched = make_scheduler(num_blocks=4)  # 16 tokens
    sched.add_request(make_request("p", prompt_of(14), max_tokens=100), hand_off=True)
    with pytest.raises(ValueError, match="more than the pool"):
        sched.add_request(make_request("q", prompt_of(14), max_tokens=100))


# ---- decode side ----------------------------------------------------------------


def admit_remote(sched: Scheduler, req: Request, num_remote: int):
    sched.add_remote_request(req, num_remote)
    output = sched.schedule()
    sched.check_invariants()
    assert output.is_empty, "a remote request is not computed while its KV is pulled"
    [allocation] = output.remote_kv_allocations
    return allocation


def test_remote_allocation_reuses_local_prefix_hits() -> None:
    sched = make_scheduler()
    model = FakeModel(sched)
    system = prompt_of(12, 3)  # three full blocks
    sched.add_request(make_request("local", system + [1, 2], max_tokens=1))
    model.run_to_completion()
    prompt = system + prompt_of(7, 4)  # 19 tokens: four full blocks and a partial
    req = handed_off(prompt)
    allocation = admit_remote(sched, req, len(prompt))
    assert allocation.request_id == "r" and allocation.num_remote_tokens == 19
    assert allocation.num_local_cached_tokens == 12
    assert (
        len(allocation.block_ids) == 5 and allocation.missing_block_ids == allocation.block_ids[3:]
    )
    assert model.read(allocation.block_ids, 12) == system, "hit blocks already hold the KV"
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched.stats().num_waiting_for_remote_kvs == 1
    assert sched.has_unfinished_requests()
    assert sched.schedule().is_empty  # still not computed
    model.fill_remote(allocation.block_ids, req, 12, 19)
    assert sched.finish_remote_kvs("r", success=True)
    computed_before = model.tokens_computed
    model.step()
    assert model.chunk_log[-1] == ("r", 19, 1, True)
    model.run_to_completion()
    assert req.output_token_ids == reference_output(prompt, 6)
    assert model.tokens_computed - computed_before == 5, "only decodes after the pull"
    sched.check_invariants()
    # the pulled prompt blocks entered the local prefix cache
    twin = make_request("twin", prompt + [5], max_tokens=1)
    sched.add_request(twin)
    assert sched.schedule().chunks[0].start == 16


def test_failed_pull_with_recompute_prefills_the_rest_locally() -> None:
    sched = make_scheduler()
    model = FakeModel(sched)
    system = prompt_of(8, 5)
    sched.add_request(make_request("local", system + [1], max_tokens=1))
    model.run_to_completion()
    prompt = system + prompt_of(10, 6)
    req = handed_off(prompt, max_tokens=4)
    allocation = admit_remote(sched, req, len(prompt))
    assert allocation.num_local_cached_tokens == 8
    assert sched.finish_remote_kvs("r", success=False, policy="recompute")
    model.step()
    # the rest of the prompt and P's first token, then the second token is sampled
    assert model.chunk_log[-1] == ("r", 8, 11, True)
    model.run_to_completion()
    assert req.output_token_ids == reference_output(prompt, 4)
    sched.check_invariants()


def test_failed_pull_with_fail_policy_ends_in_error() -> None:
    sched = make_scheduler()
    req = handed_off(prompt_of(10))
    admit_remote(sched, req, 10)
    assert sched.finish_remote_kvs("r", success=False, policy="fail", error="peer died")
    assert req.status is RequestStatus.FINISHED_ERROR and req.error == "peer died"
    assert req.status.finish_reason == "error"
    assert sched.schedule().finished_ids == ["r"]
    assert not sched.has_unfinished_requests()
    assert sched.block_manager.num_free_blocks == 64
    sched.check_invariants()
    assert not sched.finish_remote_kvs("r", success=True), "already gone"
    with pytest.raises(ValueError, match="policy"):
        sched.finish_remote_kvs("r", success=False, policy="retry")


def queue_remote_behind_a_full_pool(sched: Scheduler, prompt: list[int]):
    """A remote request left queued (no blocks yet) behind one that took every seat;
    returns it and the pulling one's allocation."""
    first = handed_off(prompt_of(10, 9), rid="first")
    allocation = admit_remote(sched, first, 10)
    req = handed_off(prompt)
    sched.add_remote_request(req, len(prompt))
    output = sched.schedule()
    assert output.remote_kv_allocations == [] and req.status is RequestStatus.WAITING
    return req, allocation


def test_a_queued_remote_request_that_fails_with_recompute_prefills_here() -> None:
    sched = make_scheduler(max_num_seqs=1)
    model = FakeModel(sched)
    prompt = prompt_of(10, 7)
    req, allocation = queue_remote_behind_a_full_pool(sched, prompt)
    free_before = sched.block_manager.num_free_blocks
    assert sched.finish_remote_kvs("r", success=False, policy="recompute", error="no handshake")
    assert req.status is RequestStatus.WAITING and sched.get_request("r") is req
    assert sched.block_manager.num_free_blocks == free_before, "nothing was allocated for it"
    assert not sched.finish_remote_kvs("r", success=False), "it is no longer remote"
    model.fill_remote(allocation.block_ids, sched.get_request("first"), 0, 10)
    assert sched.finish_remote_kvs("first", success=True)
    model.run_to_completion()
    # it ran as an ordinary request: prompt and P's first token computed here
    assert ("r", 0, 11, True) in model.chunk_log
    assert req.output_token_ids == reference_output(prompt, 6)
    assert sched.block_manager.num_free_blocks == 64
    sched.check_invariants()


def test_a_queued_remote_request_that_fails_with_fail_policy_ends_without_blocks() -> None:
    sched = make_scheduler(max_num_seqs=1)
    req, _ = queue_remote_behind_a_full_pool(sched, prompt_of(10, 8))
    free_before = sched.block_manager.num_free_blocks
    assert sched.finish_remote_kvs("r", success=False, policy="fail", error="layout differs")
    assert req.status is RequestStatus.FINISHED_ERROR and req.error == "layout differs"
    assert sched.get_request("r") is None and list(sched.waiting) == []
    assert sched.block_manager.num_free_blocks == free_before
    assert sched.schedule().finished_ids == ["r"]
    sched.check_invariants()
    assert not sched.finish_remote_kvs("r", success=False, policy="fail"), "already gone"


def test_a_queued_remote_request_cannot_succeed_without_blocks() -> None:
    sched = make_scheduler(max_num_seqs=1)
    queue_remote_behind_a_full_pool(sched, prompt_of(10, 6))
    with pytest.raises(ValueError, match="no blocks were allocated"):
        sched.finish_remote_kvs("r", success=True)


def test_aborting_while_pulling_quarantines_the_blocks_until_the_transfer_ends() -> None:
    sched = make_scheduler()
    req = handed_off(prompt_of(10))
    allocation = admit_remote(sched, req, 10)
    assert sched.abort_request("r")
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert sched.get_request("r") is None and not sched.has_unfinished_requests()
    assert sched.schedule().finished_ids == ["r"]
    # a cancelled transfer may still land in these blocks: nobody else may get them
    assert sched.get_block_ids("r") == allocation.block_ids
    assert sched.block_manager.num_free_blocks == 61
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add_request(make_request("r", prompt_of(3)))
    sched.check_invariants()
    assert not sched.finish_remote_kvs("r", success=False)  # the cancel completed
    assert sched.block_manager.num_free_blocks == 64 and sched.quarantined == {}
    assert not sched.finish_remote_kvs("r", success=True)
    sched.check_invariants()


def test_requests_pulling_kv_are_never_preempted() -> None:
    sched = make_scheduler(num_blocks=6)
    model = FakeModel(sched)
    remote = handed_off(prompt_of(12), max_tokens=4)
    allocation = admit_remote(sched, remote, 12)  # three blocks
    local = make_request("local", prompt_of(8, 1), max_tokens=6)
    sched.add_request(local)
    preempted: list[str] = []
    for _ in range(8):  # local grows by a token a step until it needs a fourth block
        preempted += model.step()[0].preempted_ids
    assert preempted == ["local"] and local.num_preemptions == 1
    assert remote.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched.get_block_ids("r") == allocation.block_ids
    model.fill_remote(allocation.block_ids, remote, 0, 12)
    sched.finish_remote_kvs("r", success=True)
    model.run_to_completion()
    assert remote.output_token_ids == reference_output(remote.prompt_token_ids, 4)
    assert local.output_token_ids == reference_output(local.prompt_token_ids, 6)
    sched.check_invariants()


def test_remote_requests_are_admitted_fcfs_within_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2)
    model = FakeModel(sched)
    sched.add_request(make_request("a", prompt_of(5), max_tokens=3))
    sched.add_remote_request(handed_off(prompt_of(6, 1), "r1", max_tokens=2), 6)
    sched.add_remote_request(handed_off(prompt_of(6, 2), "r2", max_tokens=2), 6)
    output, _ = model.step()
    assert [a.request_id for a in output.remote_kv_allocations] == ["r1"]
    assert [c.request.request_id for c in output.chunks] == ["a"]
    output, _ = model.step()
    assert output.remote_kv_allocations == []  # a and r1 fill both seats
    r1 = sched.get_request("r1")
    assert r1 is not None
    model.fill_remote(sched.get_block_ids("r1"), r1, 0, 6)
    sched.finish_remote_kvs("r1", success=True)
    admitted_at = None
    for step in range(10):
        output, _ = model.step()
        if output.remote_kv_allocations:
            admitted_at = step
            break
    assert admitted_at == 1  # a's last decode is step 0; r2 takes its seat the step after
    assert [a.request_id for a in output.remote_kv_allocations] == ["r2"]
    assert sched.get_request("a") is None


def test_remote_admission_waits_for_free_blocks() -> None:
    sched = make_scheduler(num_blocks=4)
    model = FakeModel(sched)
    sched.add_request(make_request("a", prompt_of(8), max_tokens=2))
    sched.add_remote_request(handed_off(prompt_of(9, 1), "r", max_tokens=2), 9)
    output, _ = model.step()
    assert output.remote_kv_allocations == []  # needs three blocks, two are free
    model.step()  # a finishes
    output, _ = model.step()
    assert [a.request_id for a in output.remote_kv_allocations] == ["r"]


@pytest.mark.parametrize(
    ("outputs", "num_remote", "message"),
    [([], 6, "first token"), ([3], 7, "num_remote_tokens"), ([3], 0, "num_remote_tokens")],
)
def test_bad_remote_requests_are_rejected(outputs: list[int], num_remote: int, message: str):
    sched = make_scheduler()
    req = make_request("r", prompt_of(6))
    req.output_token_ids.extend(outputs)
    with pytest.raises(ValueError, match=message):
        sched.add_remote_request(req, num_remote)
    assert sched.get_request("r") is None


# ---- the whole journey ----------------------------------------------------------


def copy_kv(src: FakeModel, src_blocks: list[int], dst: FakeModel, dst_blocks: list[int]) -> None:
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        dst.kv[d] = list(src.kv[s])


def test_prefill_to_decode_hand_off_matches_a_colocated_run() -> None:
    prefill, decode = make_scheduler(num_blocks=32), make_scheduler(num_blocks=32)
    p_model, d_model = FakeModel(prefill), FakeModel(decode)
    prompts = {f"q{i}": prompt_of(10 + 5 * i, i) for i in range(3)}
    for rid, prompt in prompts.items():
        prefill.add_request(make_request(rid, prompt, max_tokens=8), hand_off=True)
    held: list[Request] = []
    while prefill.has_unfinished_requests():
        held += p_model.step()[1]
    for req in held:
        d_req = make_request(req.request_id, req.prompt_token_ids, max_tokens=8)
        d_req.output_token_ids = list(req.output_token_ids)
        decode.add_remote_request(d_req, req.num_prompt_tokens)
    while decode.has_unfinished_requests():
        output = decode.schedule()
        for allocation in output.remote_kv_allocations:
            first = allocation.num_local_cached_tokens // BS
            p_blocks = prefill.get_block_ids(allocation.request_id)
            copy_kv(p_model, p_blocks[first:], d_model, allocation.missing_block_ids)
            assert decode.finish_remote_kvs(allocation.request_id, success=True)
            assert prefill.release_held_blocks(allocation.request_id)
        decode.update_from_output(output, d_model.execute(output))
        decode.check_invariants()
    for rid in prompts:
        assert decode.get_request(rid) is None
    for req in held:
        assert prefill.get_request(req.request_id) is None
    prefill.check_invariants()
    assert prefill.block_manager.num_free_blocks == 32
    assert decode.block_manager.num_free_blocks == 32
    assert p_model.tokens_computed == sum(len(p) for p in prompts.values())
    assert d_model.tokens_computed == 3 * 7  # decodes only


def test_a_long_prefill_leaves_a_token_for_each_decode_behind_it() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    model = FakeModel(sched)
    req = handed_off(prompt_of(30), "slow", max_tokens=4)
    fast = handed_off(prompt_of(10, 1), "fast", max_tokens=4)
    sched.add_remote_request(req, 30)
    sched.add_remote_request(fast, 10)
    _, fast_allocation = sched.schedule().remote_kv_allocations
    assert sched.finish_remote_kvs("slow", success=False, policy="recompute")
    model.fill_remote(fast_allocation.block_ids, fast, 0, 10)
    assert sched.finish_remote_kvs("fast", success=True)
    assert [r.request_id for r in sched.running] == ["slow", "fast"]
    for _ in range(3):
        output, _ = model.step()
        sizes = {c.request.request_id: c.num_new_tokens for c in output.chunks}
        assert sizes == {"slow": 7, "fast": 1}
    model.run_to_completion()
    assert fast.output_token_ids == reference_output(fast.prompt_token_ids, 4)
    assert req.output_token_ids == reference_output(req.prompt_token_ids, 4)
