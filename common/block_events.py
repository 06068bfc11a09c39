"""Prefix-cache change events an instance publishes for prefix-aware routing.

An instance's block manager records which block hashes entered (`BlockStored`) and
left (`BlockRemoved`) its prefix cache; the instance drains them into numbered
batches and publishes them (ZMQ PUB). The global scheduler mirrors each instance's
set of cached hashes from those batches; when it sees a gap in the sequence numbers
it replaces its mirror with a `BlockCacheSnapshot` and goes on from there.

Applying a batch is idempotent on a set (each event sets a hash present or absent,
and the last event about a hash decides), so a snapshot taken while events were
still pending stays correct when those events arrive later in a batch.
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag="stored", frozen=True):
    """Consecutive full blocks of one sequence entered the prefix cache."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # hash of the block before the first one, if any
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.block_hashes) * self.block_size


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True):
    """These hashes were evicted from the prefix cache."""

    block_hashes: list[bytes]


BlockEvent = BlockStored | BlockRemoved


class BlockEventBatch(msgspec.Struct, frozen=True):
    seq: int  # 1, 2, 3, ... per instance; a skipped number means events were lost
    events: list[BlockEvent]


class BlockCacheSnapshot(msgspec.Struct, frozen=True):
    """Every hash in the prefix cache. Batches with seq > `seq` apply on top of it."""

    seq: int
    block_hashes: list[bytes]


class CachedHashMirror:
    """A subscriber's copy of one instance's cached hashes, kept up to date by batches."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.seq = 0
        self.in_sync = True

    def apply(self, batch: BlockEventBatch) -> bool:
        """Applies the next batch; returns False (and stays out of sync) on a gap."""
        if batch.seq <= self.seq:
            return self.in_sync  # a batch already covered by a snapshot or seen before
        if batch.seq != self.seq + 1 or not self.in_sync:
            self.in_sync = False
            return False
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.hashes.update(event.block_hashes)
            else:
                self.hashes.difference_update(event.block_hashes)
        self.seq = batch.seq
        return True

    def reset(self, snapshot: BlockCacheSnapshot) -> None:
        self.hashes = set(snapshot.block_hashes)
        self.seq = snapshot.seq
        self.in_sync = True

    def count_cached_prefix(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a request (by hash) this instance has cached."""
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in self.hashes:
                return i
        return len(block_hashes)
