"""Per-request block tables on top of the block pool, with prefix-cache lookups.

The scheduler asks three things of it: how much of a request is already cached
(`find_cached_prefix`), to make room for a request's next tokens (`allocate_slots`,
all or nothing), and to give a request's blocks back (`free`). After each step it
registers the blocks that became full (`cache_full_blocks`), so later requests with
the same prefix — and this request after a preemption — find them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pdserve.common.block_events import BlockCacheSnapshot, BlockEventBatch
from pdserve.common.request import Request
from pdserve.scheduler.block_hash import BlockHash, extra_keys_for, hash_block
from pdserve.scheduler.block_pool import BlockPool


@dataclass
class PrefixHit:
    """The leading full blocks of a request found in the prefix cache."""

    block_ids: list[int]
    num_tokens: int  # tokens those blocks hold
    num_queried_tokens: int  # tokens the lookup was about (for the hit-rate counters)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_pending_events: int = 100_000,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, max_pending_events)
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # full-block hashes of its tokens
        self._num_registered: dict[str, int] = {}  # leading blocks already registered
        self.prefix_cache_queries = 0  # tokens looked up at admissions
        self.prefix_cache_hits = 0  # of those, tokens found cached

    # ---- sizes --------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def holder_ids(self) -> set[str]:
        """Requests that hold at least one block."""
        return set(self._tables)

    # ---- the prefix cache ---------------------------------------------------------

    def find_cached_prefix(
        self, request: Request, num_tokens: int, *, must_compute_last: bool = True
    ) -> PrefixHit:
        """The longest cached run of full blocks among the first `num_tokens` tokens.

        A request that asks for prompt logprobs it has not had finds nothing.
        With `must_compute_last` the hit leaves at least the last of those tokens to be
        computed (a step must compute something to sample from). It only looks: nothing
        changes until the hit is passed to `allocate_slots`.
        """
        if not self.enable_prefix_caching or request.computes_prompt_logprobs:
            # Prompt logprobs come from computing every prompt position: no hit for them.
            return PrefixHit([], 0, 0)
        limit = max(0, num_tokens - 1 if must_compute_last else num_tokens)
        num_full = limit // self.block_size
        block_ids: list[int] = []
        for block_hash in self._hashes_of(request, num_full)[:num_full]:
            block_id = self.pool.find_cached(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return PrefixHit(block_ids, len(block_ids) * self.block_size, num_tokens)

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's blocks that `num_computed_tokens` filled completely."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request.request_id]
        done = self._num_registered.get(request.request_id, 0)
        full = min(num_computed_tokens // self.block_size, len(table))
        if full <= done:
            return
        hashes = self._hashes_of(request, full)
        parent = hashes[done - 1] if done else None
        self.pool.register(table[done:full], hashes[done:full], parent)
        self._num_registered[request.request_id] = full

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The hashes of the request's first `num_blocks` full blocks."""
        return self._hashes_of(request, num_blocks)[:num_blocks]

    def _hashes_of(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's first `num_blocks` full-block hashes, computed once each."""
        hashes = self._hashes.setdefault(request.request_id, [])
        extra = extra_keys_for(request.cache_salt)
        size = self.block_size
        while len(hashes) < num_blocks:
            start = len(hashes) * size
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.tokens_between(start, start + size), extra))
        return hashes

    # ---- allocation ---------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_tokens: int, prefix: PrefixHit | None = None
    ) -> bool:
        """Makes the request hold blocks for `num_tokens` tokens, or changes nothing.

        `prefix` (only when the request holds no blocks yet, i.e. at admission) is
        shared rather than allocated; the hit counters move only when this succeeds.
        """
        request_id = request.request_id
        table = self._tables.get(request_id, [])
        if prefix is None and num_tokens <= len(table) * self.block_size:
            return True  # the common decode step: the last block still has room
        hit_ids = prefix.block_ids if prefix else []
        if hit_ids and table:
            raise RuntimeError(f"request {request_id} already holds blocks; no prefix to add")
        needed = self.blocks_for(num_tokens) - len(table) - len(hit_ids)
        # Hit blocks sitting unreferenced on the LRU stop being allocatable once shared.
        hits_on_lru = sum(1 for b in hit_ids if self.pool.blocks[b].ref_count == 0)
        if needed > self.pool.num_free_blocks - hits_on_lru:
            return False
        if prefix is not None:
            self.pool.touch(hit_ids)
            table = list(hit_ids)
            self._num_registered[request_id] = len(hit_ids)
            self.prefix_cache_queries += prefix.num_queried_tokens
            self.prefix_cache_hits += prefix.num_tokens
        if needed > 0:
            table.extend(self.pool.take_free(needed))
        self._tables[request_id] = table
        return True

    def free(self, request_id: str) -> None:
        """Gives the request's blocks back; its tail goes first when the cache evicts."""
        table = self._tables.pop(request_id, [])
        self.pool.release(table[::-1])
        self._hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)

    # ---- events for prefix-aware routing -------------------------------------------

    def drain_events(self) -> BlockEventBatch | None:
        return self.pool.drain_events()

    def snapshot(self) -> BlockCacheSnapshot:
        return self.pool.snapshot()

    # ---- invariants ---------------------------------------------------------------

    def owners(self) -> dict[int, set[str]]:
        table: dict[int, set[str]] = {}
        for request_id, block_ids in self._tables.items():
            for block_id in block_ids:
                table.setdefault(block_id, set()).add(request_id)
        return table

    def check_invariants(self) -> None:
        """Raises AssertionError naming the first broken invariant."""
        self.pool.check_consistency()
        for request_id, block_ids in self._tables.items():
            twice = [b for b, n in Counter(block_ids).items() if n > 1]
            _check(not twice, f"request {request_id} holds blocks {twice} twice")
        owners = self.owners()
        for block in self.pool.blocks:
            holders = owners.get(block.block_id, set())
            _check(
                block.ref_count == len(holders),
                f"block {block.block_id} has ref_count {block.ref_count} "
                f"but {len(holders)} holders {sorted(holders)}",
            )
        if not self._tables:
            _check(
                self.num_free_blocks == self.num_blocks,
                f"no request holds blocks yet only {self.num_free_blocks} of "
                f"{self.num_blocks} are free or cached",
            )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
