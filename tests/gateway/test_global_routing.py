"""Routing policies on fake instance views: no processes, no sockets."""

from __future__ import annotations

import pytest

from pdserve.common.block_events import BlockEventBatch, BlockRemoved, BlockStored
from pdserve.common.messages import InstanceStats
from pdserve.gateway.routing import (
    InstanceView,
    LoadAwarePolicy,
    PrefillSkipDecider,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    RouteRequest,
    make_policy,
)
from pdserve.scheduler.block_hash import extra_keys_for, hash_full_blocks
from tests.gateway.instances import BLOCK, instance_info


def view(instance_id: str, role: str = "prefill", blocks: int = 100, **stats) -> InstanceView:
    v = InstanceView(info=instance_info(instance_id, role, blocks), last_seen=0.0)
    if stats:
        v.stats = InstanceStats(num_total_blocks=blocks, **stats)
    return v


def request(tokens: list[int], salt: str = "", rid: str = "r") -> RouteRequest:
    return RouteRequest(rid, tokens, salt)


def store(v: InstanceView, tokens: list[int], salt: str = "", seq: int | None = None) -> None:
    hashes = hash_full_blocks(tokens, BLOCK, extra_keys_for(salt))
    batch = BlockEventBatch(seq or v.mirror.seq + 1, [BlockStored(hashes, None, BLOCK)])
    assert v.mirror.apply(batch)


def test_round_robin_cycles_each_pool_in_id_order() -> None:
    policy = RoundRobinPolicy()
    pool = [view("p1"), view("p0"), view("p2")]
    picks = [policy.pick_prefill(pool, request([1])).instance_id for _ in range(6)]
    assert picks == ["p0", "p1", "p2", "p0", "p1", "p2"]
    decoders = [view("d1", "decode"), view("d0", "decode")]
    # The decode pool keeps its own turn.
    assert [policy.pick_decode(decoders, request([1])).instance_id for _ in range(3)] == [
        "d0",
        "d1",
        "d0",
    ]


def test_load_aware_prefill_takes_fewest_queued_prompt_tokens() -> None:
    policy = LoadAwarePolicy()
    busy, idle = view("p0", queued_prefill_tokens=500), view("p1", queued_prefill_tokens=20)
    assert policy.pick_prefill([busy, idle], request([1] * 8)) is idle
    # Requests the gateway sent since (not in the stats yet) count too.
    idle.unstarted_tokens["x"] = 900
    assert policy.pick_prefill([busy, idle], request([1] * 8)) is busy


def test_load_aware_decode_takes_most_free_blocks_then_fewest_in_flight() -> None:
    policy = LoadAwarePolicy()
    full = view("d0", "decode", num_free_blocks=10)
    roomy = view("d1", "decode", num_free_blocks=90)
    assert policy.pick_decode([full, roomy], request([1])) is roomy
    tied = [view("d0", "decode", num_free_blocks=50), view("d1", "decode", num_free_blocks=50)]
    tied[0].in_flight.update({"a", "b"})
    assert policy.pick_decode(tied, request([1])) is tied[1]


def test_load_aware_spreads_a_burst_before_stats_catch_up() -> None:
    policy = LoadAwarePolicy()
    pool = [view("d0", "decode", num_free_blocks=100), view("d1", "decode", num_free_blocks=100)]
    counts = {"d0": 0, "d1": 0}
    for i in range(10):
        picked = policy.pick_decode(pool, request([1] * 16, rid=str(i)))
        picked.pending_blocks += 4  # what GlobalScheduler.assign records
        picked.in_flight.add(str(i))
        counts[picked.instance_id] += 1
    assert counts == {"d0": 5, "d1": 5}


def test_prefix_aware_follows_the_cached_prefix_of_the_tenant() -> None:
    policy = PrefixAwarePolicy()
    document = list(range(1, 65))  # 16 full blocks
    cold, warm = view("p0"), view("p1")
    store(warm, document, salt="tenant-a")
    assert warm.cached_prefix_tokens(request(document + [7], "tenant-a")) == 64
    assert policy.pick_prefill([cold, warm], request(document + [7, 8], "tenant-a")) is warm
    # Another tenant's hashes differ: no preference, the tie goes by load then id.
    assert warm.cached_prefix_tokens(request(document, "tenant-b")) == 0
    assert policy.pick_prefill([cold, warm], request(document, "tenant-b")) is cold


def test_prefix_aware_stops_preferring_an_instance_after_eviction() -> None:
    policy = PrefixAwarePolicy()
    document = list(range(1, 33))
    cold, warm = view("p0"), view("p1")
    store(warm, document)
    assert policy.pick_prefill([cold, warm], request(document)) is warm
    hashes = hash_full_blocks(document, BLOCK)
    assert warm.mirror.apply(BlockEventBatch(warm.mirror.seq + 1, [BlockRemoved(hashes[:1])]))
    # The first block is gone, so nothing after it is a usable prefix.
    assert warm.cached_prefix_tokens(request(document)) == 0
    assert policy.pick_prefill([cold, warm], request(document)) is cold


def test_prefix_aware_weighs_the_cache_against_the_queue() -> None:
    policy = PrefixAwarePolicy()
    document = list(range(1, 33))  # 32 tokens, all cached on p1
    idle, warm = view("p0"), view("p1", queued_prefill_tokens=1000)
    store(warm, document)
    # Computing 32 tokens on an idle instance beats waiting behind 1000 tokens.
    assert policy.pick_prefill([idle, warm], request(document)) is idle
    warm.stats = InstanceStats(queued_prefill_tokens=10, num_total_blocks=100)
    assert policy.pick_prefill([idle, warm], request(document)) is warm


def test_colocated_pick_uses_prefix_and_load() -> None:
    policy = PrefixAwarePolicy()
    document = list(range(1, 41))
    a, b = view("c0", "colocated"), view("c1", "colocated")
    store(b, document)
    assert policy.pick_colocated([a, b], request(document)) is b
    assert LoadAwarePolicy().pick_colocated([a, b], request(document)) is a  # ties by id


def test_prefill_skip_decider_thresholds() -> None:
    decode = view("d0", "decode")
    document = list(range(1, 41))  # 10 full blocks
    store(decode, document[:32])  # 8 of them cached
    assert not PrefillSkipDecider().should_skip(request([1] * 4), decode)  # off by default
    short = PrefillSkipDecider(max_prompt_tokens=16)
    assert short.should_skip(request([1] * 16), decode)
    assert not short.should_skip(request([1] * 17), decode)
    cached = PrefillSkipDecider(min_cached_ratio=0.8)
    assert cached.should_skip(request(document), decode)  # 32 of 40 cached
    assert not PrefillSkipDecider(min_cached_ratio=0.9).should_skip(request(document), decode)
    with pytest.raises(ValueError, match="min_cached_ratio"):
        PrefillSkipDecider(min_cached_ratio=1.5)


def test_make_policy_names() -> None:
    assert isinstance(make_policy("round_robin"), RoundRobinPolicy)
    assert isinstance(make_policy("prefix_aware"), PrefixAwarePolicy)
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest")
