"""Property-based: random request traffic against small pools keeps the books straight.

Hypothesis drives adds (local, hand-off and remote requests over shared prefixes and
two tenants), steps with random sampled tokens (eos among them), aborts, pulls that
succeed or fail, and releases of held blocks, on pools small enough to force
preemptions. After every operation the block books must balance; the fake model
checks on every chunk that the KV it reads back is the request's own tokens; and once
everything has drained, every block is free or held only by the prefix cache.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from pdserve.common.request import Request, RequestStatus
from pdserve.scheduler.config import SchedulerConfig
from pdserve.scheduler.outputs import RemoteKVAllocation
from pdserve.scheduler.step_scheduler import Scheduler
from tests.scheduler.fake_model import FakeModel, make_request, reference_output

EOS = 0
PREFIXES = [[], [11, 12, 13, 14, 15, 16], [11, 12, 13, 14, 21], [31, 32, 33]]


def assert_books_balance(sched: Scheduler) -> None:
    """The block invariants, recomputed here independently of check_invariants()."""
    bm = sched.block_manager
    owners: dict[int, set[str]] = {}
    for rid in bm.holder_ids():
        table = bm.get_block_ids(rid)
        assert len(set(table)) == len(table), f"{rid} holds a block twice: {table}"
        for block in table:
            owners.setdefault(block, set()).add(rid)
    free = list(bm.pool._free) + list(bm.pool._evictable)
    assert len(free) == len(set(free)), "a block is free twice"
    assert not set(free) & set(owners), "a block is both free and owned"
    for block in bm.pool.blocks:
        holders = owners.get(block.block_id, set())
        assert block.ref_count == len(holders), f"block {block.block_id}: {block} vs {holders}"
    assert len(free) + len(owners) == bm.num_blocks, "a block is neither free nor owned"


def drawn_scheduler(
    num_blocks: int,
    block_size: int,
    max_batched: int,
    max_num_seqs: int,
    prefix_caching: bool,
    chunked: bool,
    max_model_len: int,
) -> Scheduler:
    """A scheduler of drawn limits; without chunking a whole prompt fits one step."""
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=max_batched if chunked else max_model_len,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 12),
        block_size=st.sampled_from([2, 3]),
        max_batched=st.integers(3, 24),
        max_num_seqs=st.integers(1, 4),
        prefix_caching=st.booleans(),
        chunked=st.booleans(),
    )
    def start(self, num_blocks, block_size, max_batched, max_num_seqs, prefix_caching, chunked):
        self.sched = drawn_scheduler(
            num_blocks, block_size, max_batched, max_num_seqs, prefix_caching, chunked, 24
        )
        self.model = FakeModel(self.sched, vocab=6)
        self.allocations: dict[str, RemoteKVAllocation] = {}
        self.next_id = 0
        self.outputs_seen: Counter[str] = Counter()

    def new_request(self, prefix: int, suffix: list[int], salt: str, **params) -> Request:
        self.next_id += 1
        prompt = PREFIXES[prefix] + suffix
        return make_request(f"r{self.next_id}", prompt, salt=salt, eos=frozenset({EOS}), **params)

    def fits(self, request: Request, kv_tokens: int) -> bool:
        return -(-kv_tokens // self.sched.config.block_size) <= self.sched.config.num_blocks

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        suffix=st.lists(st.integers(1, 5), max_size=6),
        salt=st.sampled_from(["", "tenant"]),
        max_tokens=st.integers(1, 8),
        min_tokens=st.integers(0, 2),
        ignore_eos=st.booleans(),
        hand_off=st.booleans(),
    )
    def add(self, prefix, suffix, salt, max_tokens, min_tokens, ignore_eos, hand_off):
        min_tokens = min(min_tokens, max_tokens)
        req = self.new_request(
            prefix,
            suffix,
            salt,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
        )
        n = req.num_prompt_tokens
        kv_tokens = n if hand_off else max(n, min(n + max_tokens, 24) - 1)
        try:
            self.sched.add_request(req, hand_off=hand_off)
        except ValueError as error:
            assert n == 0 or not self.fits(req, kv_tokens), str(error)
        else:
            assert n > 0 and self.fits(req, kv_tokens)

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        suffix=st.lists(st.integers(1, 5), max_size=6),
        first_token=st.integers(1, 5),
        max_tokens=st.integers(2, 6),
    )
    def add_remote(self, prefix, suffix, first_token, max_tokens):
        req = self.new_request(prefix, suffix, "", max_tokens=max_tokens)
        if not req.prompt_token_ids:
            return
        req.output_token_ids.append(first_token)
        n = req.num_prompt_tokens
        try:
            self.sched.add_remote_request(req, n)
        except ValueError:
            assert not self.fits(req, max(n + 1, min(n + max_tokens, 24) - 1))

    @rule(steps=st.integers(1, 4), tokens=st.lists(st.integers(0, 5), min_size=1, max_size=6))
    def step(self, steps, tokens):
        feed = iter(tokens * 200)
        for _ in range(steps):
            self.step_once(feed)
            self.books_balance()

    def step_once(self, feed) -> None:
        output = self.sched.schedule()
        self.sched.check_invariants()
        for allocation in output.remote_kv_allocations:
            self.allocations[allocation.request_id] = allocation
            event("remote allocation")
        if output.preempted_ids:
            event("preemption")
        if any(c.start > 0 and c.request.num_preemptions == 0 for c in output.chunks):
            event("chunk after a prefix hit or an earlier chunk")
        sampled = self.model.execute(output, lambda request, context: next(feed))
        counts = {c.request.request_id: c.request.num_output_tokens for c in output.chunks}
        left = self.sched.update_from_output(output, sampled)
        for chunk in output.chunks:
            req = chunk.request
            grew = req.num_output_tokens - counts[req.request_id]
            assert grew == (1 if req.request_id in sampled else 0)
            if req.is_finished:
                assert req in left
        for req in left:
            event(req.status.name)
            assert req.status.finished or req.status is RequestStatus.HANDED_OFF
            assert self.sched.get_request(req.request_id) in (None, req)
            if req.status.finished:
                assert not self.sched.get_block_ids(req.request_id)

    @rule(data=st.data(), stop=st.booleans())
    def end_one(self, data, stop):
        if not self.sched.requests:
            return
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        status = RequestStatus.FINISHED_STOPPED if stop else RequestStatus.FINISHED_ABORTED
        in_transfer = rid in self.sched.waiting_for_remote or rid in self.sched.held
        assert self.sched.finish_request(rid, status)
        assert bool(self.sched.get_block_ids(rid)) == in_transfer  # quarantined till it ends

    def pulling(self) -> list[str]:
        quarantined = [rid for rid in self.sched.quarantined if rid in self.allocations]
        return sorted(self.sched.waiting_for_remote) + sorted(quarantined)

    def handed_off(self) -> list[str]:
        quarantined = [rid for rid in self.sched.quarantined if rid not in self.allocations]
        return sorted(self.sched.held) + sorted(quarantined)

    @rule(data=st.data(), success=st.booleans(), recompute=st.booleans())
    def finish_pull(self, data, success, recompute):
        pulling = self.pulling()
        if not pulling:
            return
        rid = data.draw(st.sampled_from(pulling))
        self.complete_pull(rid, success, "recompute" if recompute else "fail")

    def complete_pull(self, rid: str, success: bool, policy: str) -> None:
        allocation = self.allocations.pop(rid)
        if rid in self.sched.quarantined:  # ended while pulling: the pull ends too
            assert not self.sched.finish_remote_kvs(rid, success, policy)
            assert not self.sched.get_block_ids(rid)
            return
        req = self.sched.waiting_for_remote[rid]
        if success:
            self.model.fill_remote(
                allocation.block_ids,
                req,
                allocation.num_local_cached_tokens,
                allocation.num_remote_tokens,
            )
        assert self.sched.finish_remote_kvs(rid, success, policy)
        if success or policy == "recompute":
            assert req.status is RequestStatus.RUNNING
        else:
            assert req.status is RequestStatus.FINISHED_ERROR and req.error

    @rule(data=st.data())
    def release_held(self, data):
        if not self.handed_off():
            return
        rid = data.draw(st.sampled_from(self.handed_off()))
        assert self.sched.release_held_blocks(rid)
        assert not self.sched.get_block_ids(rid)

    @invariant()
    def books_balance(self):
        if hasattr(self, "sched"):
            self.sched.check_invariants()
            assert_books_balance(self.sched)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        for _ in range(500):
            for rid in self.handed_off():
                assert sched.release_held_blocks(rid)
            for rid in self.pulling():
                self.complete_pull(rid, True, "recompute")
            if not sched.has_unfinished_requests():
                break
            output = sched.schedule()
            for allocation in output.remote_kv_allocations:
                self.allocations[allocation.request_id] = allocation
            sched.update_from_output(output, self.model.execute(output))
            sched.check_invariants()
        assert not sched.has_unfinished_requests(), "requests never drained"
        for rid in self.handed_off():
            assert sched.release_held_blocks(rid)
        assert sched.quarantined == {}
        sched.check_invariants()
        assert_books_balance(sched)
        assert sched.block_manager.holder_ids() == set()
        assert sched.block_manager.num_free_blocks == sched.config.num_blocks
        assert sched.stats().kv_cache_usage_perc == 0.0


SchedulerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_scheduler_keeps_its_books_under_random_traffic = SchedulerMachine.TestCase


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(4, 12),
    block_size=st.sampled_from([2, 3, 4]),
    max_batched=st.integers(2, 16),
    max_num_seqs=st.integers(1, 4),
    prefix_caching=st.booleans(),
    chunked=st.booleans(),
    workload=st.lists(
        st.tuples(
            st.integers(0, len(PREFIXES) - 1),  # shared prefix
            st.lists(st.integers(1, 5), max_size=6),  # own suffix
            st.integers(1, 8),  # max_tokens
            st.sampled_from(["", "tenant"]),  # cache salt
            st.integers(0, 4),  # arrival step
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_any_schedule_generates_what_an_unconstrained_one_would(
    num_blocks, block_size, max_batched, max_num_seqs, prefix_caching, chunked, workload
):
    """Chunking, batching, prefix hits and preemptions never change a single token."""
    max_model_len = 20
    sched = drawn_scheduler(
        num_blocks, block_size, max_batched, max_num_seqs, prefix_caching, chunked, max_model_len
    )
    model = FakeModel(sched)
    accepted: list[Request] = []
    arrivals = sorted(enumerate(workload), key=lambda item: item[1][4])
    step = 0
    while arrivals or sched.has_unfinished_requests():
        while arrivals and arrivals[0][1][4] <= step:
            i, (prefix, suffix, max_tokens, salt, _) = arrivals.pop(0)
            req = make_request(f"r{i}", PREFIXES[prefix] + suffix, max_tokens=max_tokens, salt=salt)
            try:
                sched.add_request(req)
                accepted.append(req)
            except ValueError:
                n = req.num_prompt_tokens
                kv_tokens = max(n, min(n + max_tokens, max_model_len) - 1)
                assert n == 0 or -(-kv_tokens // block_size) > num_blocks
        model.step()
        step += 1
        assert step < 1000, "the workload never drained"
    if sched.num_preemptions_total:
        event("preempted")
    if sched.stats().prefix_cache_hits_total:
        event("prefix hit")
    for req in accepted:
        expected = reference_output(req.prompt_token_ids, req.sampling_params.max_tokens)
        expected = expected[: max_model_len - req.num_prompt_tokens]
        assert req.output_token_ids == expected, req.request_id
    sched.check_invariants()
    assert_books_balance(sched)
    assert sched.block_manager.num_free_blocks == num_blocks
