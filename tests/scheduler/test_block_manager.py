"""The block manager: allocation, reference counts, prefix hits, LRU eviction, events."""

from __future__ import annotations

import pytest

from pdserve.common.block_events import BlockRemoved, BlockStored, CachedHashMirror
from pdserve.scheduler.block_hash import extra_keys_for, hash_full_blocks
from pdserve.scheduler.block_manager import BlockManager
from tests.scheduler.fake_model import make_request

BS = 4


def admit(bm: BlockManager, request, must_compute_last: bool = True) -> int:
    """Admits a request whole (prefix hit + the rest) and marks it computed."""
    hit = bm.find_cached_prefix(request, request.num_tokens, must_compute_last=must_compute_last)
    assert bm.allocate_slots(request, request.num_tokens, hit)
    bm.cache_full_blocks(request, request.num_tokens)
    bm.check_invariants()
    return hit.num_tokens


def test_allocate_takes_ceil_blocks_and_free_returns_them() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(9)))
    assert bm.allocate_slots(req, 9)
    assert len(bm.get_block_ids("a")) == 3
    assert bm.num_free_blocks == 7
    assert bm.allocate_slots(req, 12)  # still fits in 3 blocks
    assert len(bm.get_block_ids("a")) == 3
    assert bm.allocate_slots(req, 13)
    assert len(bm.get_block_ids("a")) == 4
    assert bm.usage() == pytest.approx(0.4)
    bm.check_invariants()
    bm.free("a")
    assert bm.num_free_blocks == 10 and bm.usage() == 0.0
    bm.check_invariants()


def test_allocation_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a, b = make_request("a", [1] * 8), make_request("b", [2] * 12)
    assert bm.allocate_slots(a, 8)
    before = (bm.num_free_blocks, bm.owners())
    assert not bm.allocate_slots(b, 12)  # needs 3, 2 free
    assert (bm.num_free_blocks, bm.owners()) == before
    assert bm.get_block_ids("b") == []
    bm.check_invariants()


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    shared = list(range(100, 112))  # three full blocks
    a = make_request("a", shared + [1, 2])
    b = make_request("b", shared + [3, 4, 5])
    assert admit(bm, a) == 0
    assert admit(bm, b) == 12
    assert bm.get_block_ids("a")[:3] == bm.get_block_ids("b")[:3]
    assert bm.get_block_ids("a")[3] != bm.get_block_ids("b")[3]
    owners = bm.owners()
    for block in bm.get_block_ids("a")[:3]:
        assert owners[block] == {"a", "b"}
        assert bm.pool.blocks[block].ref_count == 2
    assert bm.prefix_cache_queries == a.num_tokens + b.num_tokens
    assert bm.prefix_cache_hits == 12


def test_hit_never_covers_every_token_when_one_must_be_computed() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(8))  # exactly two blocks
    admit(bm, make_request("a", prompt))
    twin = make_request("b", prompt)
    hit = bm.find_cached_prefix(twin, twin.num_tokens)
    assert hit.num_tokens == 4, "the last block is recomputed so a token is left to compute"
    full = bm.find_cached_prefix(twin, twin.num_tokens, must_compute_last=False)
    assert full.num_tokens == 8


def test_different_salts_never_share_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(13))
    admit(bm, make_request("a", prompt, salt="tenant-1"))
    assert admit(bm, make_request("b", prompt, salt="tenant-2")) == 0
    assert admit(bm, make_request("c", prompt, salt="tenant-1")) == 12
    assert not set(bm.get_block_ids("a")) & set(bm.get_block_ids("b"))


def test_freed_cached_blocks_stay_reusable_until_needed() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(9))
    admit(bm, make_request("a", prompt))
    cached_blocks = bm.get_block_ids("a")[:2]
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.pool.num_cached_blocks == 2
    # A small unrelated request takes plain free blocks and leaves the cache alone.
    assert bm.allocate_slots(make_request("x", [7] * 4), 4)
    assert bm.pool.num_cached_blocks == 2
    bm.free("x")
    again = make_request("b", prompt)
    assert admit(bm, again) == 8
    assert bm.get_block_ids("b")[:2] == cached_blocks
    bm.check_invariants()


def test_eviction_is_least_recently_freed_and_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    first = make_request("first", list(range(0, 12)))  # 3 full blocks
    second = make_request("second", list(range(50, 62)))
    admit(bm, first)
    admit(bm, second)
    first_blocks, second_blocks = bm.get_block_ids("first"), bm.get_block_ids("second")
    bm.free("first")
    bm.free("second")
    assert bm.pool.num_cached_blocks == 6
    # Freed in reverse, so the LRU order is: first's tail .. head, then second's.
    expected_order = first_blocks[::-1] + second_blocks[::-1]
    taker = make_request("t", [9] * 4)
    for step, victim in enumerate(expected_order, start=1):
        assert bm.allocate_slots(taker, step * BS)
        assert bm.get_block_ids("t")[-1] == victim
        assert bm.pool.blocks[victim].block_hash is None
    # the head of `first` went last among first's blocks: a shared prefix survives longest
    bm.check_invariants()


def test_hit_on_an_unreferenced_block_pulls_it_off_the_lru() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    prompt = list(range(8))
    admit(bm, make_request("a", prompt))
    bm.free("a")  # 2 cached-unreferenced + 1 free
    b = make_request("b", prompt + [1, 2, 3, 4, 5])  # 13 tokens: 4 blocks
    hit = bm.find_cached_prefix(b, b.num_tokens)
    assert hit.num_tokens == 8
    # 2 hit blocks + 2 new ones needed, but only 1 block is not a hit: refuse, change nothing.
    assert not bm.allocate_slots(b, 13, hit)
    assert bm.pool.num_cached_blocks == 2 and bm.num_free_blocks == 3
    assert bm.prefix_cache_queries == 8  # only a's admission counted
    assert bm.allocate_slots(b, 12, hit)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_duplicate_full_block_is_not_registered_twice() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(8))
    admit(bm, make_request("a", prompt))
    b = make_request("b", prompt)
    admit(bm, b)  # hits block 0, recomputes block 1 into a block of its own
    assert bm.get_block_ids("b")[1] != bm.get_block_ids("a")[1]
    assert bm.pool.blocks[bm.get_block_ids("b")[1]].block_hash is None
    bm.free("a")
    bm.free("b")
    assert bm.pool.num_cached_blocks == 2
    bm.check_invariants()


def test_output_tokens_enter_the_cache_once_their_block_is_full() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request("a", [1, 2, 3])
    assert bm.allocate_slots(req, 3)
    bm.cache_full_blocks(req, 3)
    assert bm.pool.num_cached_blocks == 0
    req.output_token_ids.append(4)
    bm.cache_full_blocks(req, 4)
    assert bm.pool.num_cached_blocks == 1
    twin = make_request("b", [1, 2, 3, 4, 5])
    assert bm.find_cached_prefix(twin, 5).num_tokens == 4


def test_disabled_prefix_cache_finds_and_keeps_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    admit(bm, make_request("a", list(range(12))))
    bm.free("a")
    assert bm.pool.num_cached_blocks == 0
    assert admit(bm, make_request("b", list(range(12)))) == 0
    assert bm.drain_events() is None


def test_events_report_stores_and_evictions_in_numbered_batches() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    prompt = list(range(9))
    admit(bm, make_request("a", prompt, salt="s"))
    hashes = hash_full_blocks(prompt, BS, extra_keys_for("s"))
    batch = bm.drain_events()
    assert batch is not None and batch.seq == 1
    assert batch.events == [BlockStored(hashes, None, BS)]
    assert batch.events[0].num_tokens == 8
    assert bm.drain_events() is None
    bm.free("a")
    assert bm.allocate_slots(make_request("x", [5] * 12), 12)  # evicts both cached blocks
    batch = bm.drain_events()
    assert batch is not None and batch.seq == 2
    assert batch.events == [BlockRemoved([hashes[1], hashes[0]])]  # tail first


def test_stored_event_names_the_parent_of_a_later_run() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(6)))
    assert bm.allocate_slots(req, 6)
    bm.cache_full_blocks(req, 6)
    req.output_token_ids.extend([6, 7])
    assert bm.allocate_slots(req, 8)
    bm.cache_full_blocks(req, 8)
    batch = bm.drain_events()
    hashes = hash_full_blocks(list(range(8)), BS)
    assert batch is not None
    assert batch.events == [
        BlockStored([hashes[0]], None, BS),
        BlockStored([hashes[1]], hashes[0], BS),
    ]


def test_mirror_follows_batches_and_resyncs_from_a_snapshot_after_a_gap() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    mirror = CachedHashMirror()
    admit(bm, make_request("a", list(range(9))))
    assert mirror.apply(bm.drain_events())
    bm.free("a")
    admit(bm, make_request("b", list(range(20, 29))))  # evicts one of a's blocks
    lost = bm.drain_events()
    assert lost is not None  # never delivered
    bm.free("b")
    admit(bm, make_request("c", list(range(40, 45))))
    snapshot_taken_early = bm.snapshot()  # events still pending are already in it
    late = bm.drain_events()
    assert late is not None
    assert not mirror.apply(late), "a gap must be detected"
    assert not mirror.in_sync
    mirror.reset(snapshot_taken_early)
    assert mirror.apply(late)  # idempotent on top of a snapshot that already has it
    assert mirror.hashes == set(bm.snapshot().block_hashes)
    assert mirror.hashes == set(bm.pool._cached)
    c_hashes = hash_full_blocks(list(range(40, 45)), BS)
    assert mirror.count_cached_prefix(c_hashes + [b"\0" * 32]) == 1


def test_undrained_events_overflow_into_a_gap() -> None:
    bm = BlockManager(num_blocks=64, block_size=BS, max_pending_events=3)
    for i in range(5):
        admit(bm, make_request(f"r{i}", [i] * 4 + [99]))
    batch = bm.drain_events()
    assert batch is not None and batch.seq == 2, "dropped events must skip a number"
    assert len(batch.events) == 2


def test_check_invariants_catches_a_wrong_reference_count() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert bm.allocate_slots(make_request("a", [1] * 5), 5)
    bm.pool.blocks[bm.get_block_ids("a")[0]].ref_count = 2
    with pytest.raises(AssertionError, match="ref_count 2 but 1 holders"):
        bm.check_invariants()


def test_check_invariants_catches_a_block_owned_and_free() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert bm.allocate_slots(make_request("a", [1] * 5), 5)
    bm.pool._free.append(bm.get_block_ids("a")[0])
    with pytest.raises(AssertionError, match="free list"):
        bm.check_invariants()


def test_check_invariants_catches_a_block_held_twice_by_one_request() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert bm.allocate_slots(make_request("a", [1] * 5), 5)
    table = bm._tables["a"]
    bm.pool.release([table[1]])
    table[1] = table[0]
    bm.pool.touch([table[0]])
    with pytest.raises(AssertionError, match="twice"):
        bm.check_invariants()
