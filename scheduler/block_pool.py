"""The pool of KV blocks: reference counts, free lists, and the hash → block table.

A block with no references is either plain free (no hash) or cached-unreferenced:
it still holds a prefix-cache hash and can be reused by that hash until an
allocation needs it. Allocations take plain free blocks first and evict cached ones
only when none are left, least recently freed first, so the cache keeps as much as
the pool allows.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from pdserve.common.block_events import (
    BlockCacheSnapshot,
    BlockEvent,
    BlockEventBatch,
    BlockRemoved,
    BlockStored,
)
from pdserve.scheduler.block_hash import BlockHash


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, max_pending_events: int = 100_000) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        # Unreferenced blocks that still hold a hash, oldest-freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}
        self._events: list[BlockEvent] = []
        self._last_seq = 0
        self._max_pending_events = max_pending_events

    # ---- counting -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: plain free plus cached-unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of the pool in use; cached-unreferenced blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- lookup -------------------------------------------------------------------

    def find_cached(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    # ---- references ---------------------------------------------------------------

    def take_free(self, count: int) -> list[int]:
        """Hands out `count` unreferenced blocks (evicting cached ones if needed)."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} blocks, only {self.num_free_blocks} free")
        taken = []
        for _ in range(count):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._evict(self.blocks[block_id])
            self.blocks[block_id].ref_count = 1
            taken.append(block_id)
        return taken

    def touch(self, block_ids: list[int]) -> None:
        """Adds a reference to each block (a prefix-cache hit), pulling it off the LRU."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drops one reference from each block; the first in the list is evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released with no references")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None

    # ---- the prefix cache ---------------------------------------------------------

    def register(
        self, block_ids: list[int], hashes: list[BlockHash], parent: BlockHash | None
    ) -> None:
        """Records full blocks under their hashes; a hash already cached keeps its block."""
        stored: list[BlockHash] = []
        stored_parent = previous = parent
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            block = self.blocks[block_id]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block_id
                if not stored:
                    stored_parent = previous
                stored.append(block_hash)
            elif stored:
                self._record(BlockStored(stored, stored_parent, self.block_size))
                stored = []
            previous = block_hash
        if stored:
            self._record(BlockStored(stored, stored_parent, self.block_size))

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        self._record(BlockRemoved([block.block_hash]))
        block.block_hash = None

    # ---- events -------------------------------------------------------------------

    def _record(self, event: BlockEvent) -> None:
        if len(self._events) >= self._max_pending_events:
            # Nobody drains: drop them and skip a sequence number so subscribers resync.
            self._events.clear()
            self._last_seq += 1
        last = self._events[-1] if self._events else None
        if isinstance(event, BlockRemoved) and isinstance(last, BlockRemoved):
            last.block_hashes.extend(event.block_hashes)
        else:
            self._events.append(event)

    def drain_events(self) -> BlockEventBatch | None:
        if not self._events:
            return None
        self._last_seq += 1
        batch = BlockEventBatch(self._last_seq, self._events)
        self._events = []
        return batch

    def snapshot(self) -> BlockCacheSnapshot:
        return BlockCacheSnapshot(self._last_seq, list(self._cached))

    # ---- checks -------------------------------------------------------------------

    def check_consistency(self) -> None:
        """Raises AssertionError when the free lists, hashes or table disagree."""
        free, evictable = set(self._free), set(self._evictable)
        _check(len(free) == len(self._free), "a block sits twice in the free list")
        _check(not free & evictable, f"blocks both free and evictable: {free & evictable}")
        for block in self.blocks:
            unreferenced = block.block_id in free or block.block_id in evictable
            _check(
                unreferenced == (block.ref_count == 0),
                f"block {block.block_id} has ref_count {block.ref_count} but "
                f"{'is' if unreferenced else 'is not'} on a free list",
            )
            if block.block_id in free:
                _check(block.block_hash is None, f"free block {block.block_id} has a hash")
            if block.block_id in evictable:
                _check(block.block_hash is not None, f"evictable {block.block_id} has no hash")
            if block.block_hash is not None:
                _check(
                    self._cached.get(block.block_hash) == block.block_id,
                    f"block {block.block_id}'s hash maps elsewhere in the cache table",
                )
        _check(
            all(self.blocks[b].block_hash == h for h, b in self._cached.items()),
            "the cache table names a block that does not hold that hash",
        )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
