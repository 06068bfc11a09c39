"""The `lpm` admission order: waiting requests with the longest cached prefix first.

First come first served makes a request whose prompt is mostly in the prefix cache (a
RAG prompt over a document another request has just read) wait behind every earlier
prompt that must be computed in full, and admits a request that shares its document
with one still being computed beside it, to compute the same blocks a second time.
Under `lpm` (SGLang's longest-prefix-match policy) the scheduler tries the waiting
requests in order of the tokens the cache holds for them, longest first, arrival
breaking ties; and a request whose next prompt block a running request is computing
waits for that block to be cached instead of computing it again.

Kept in arrival order, ahead of the rest: preempted requests (they were running),
requests pulling remote KV, and any request passed over MAX_PASSES times (so a prompt
with nothing cached is not starved by a stream of cached ones). Past the first
MAX_REORDERED waiting requests the queue stays in arrival order: the lookups cost
time, and a queue that long is served in order anyway.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from pdserve.common.request import Request, RequestStatus
from pdserve.scheduler.block_hash import BlockHash
from pdserve.scheduler.block_manager import BlockManager, PrefixHit

MAX_REORDERED = 128
MAX_PASSES = 16


class PrefixOrder:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.passes: dict[str, int] = {}  # waiting request -> admissions that went ahead of it
        self._in_flight: set[BlockHash] = set()  # prompt blocks running requests will compute

    def order(self, queued: list[Request], remote_ids: Collection[str]) -> list[Request]:
        """The waiting requests (`queued`, in arrival order) in the order to try admitting
        them: preempted and starved ones first, requests pulling remote KV in their
        places, and the places of the others taken longest cached prefix first."""
        head, rest = queued[:MAX_REORDERED], queued[MAX_REORDERED:]
        first = [r for r in head if self._keeps_priority(r)]
        keyed = [
            ((-self._cached_tokens(r), i), r)
            for i, r in enumerate(head)
            if not self._keeps_priority(r) and r.request_id not in remote_ids
        ]
        movable = iter(r for _, r in sorted(keyed, key=lambda pair: pair[0]))
        placed = [
            r if r.request_id in remote_ids else next(movable)
            for r in head
            if not self._keeps_priority(r)
        ]
        return first + placed + rest

    def _keeps_priority(self, request: Request) -> bool:
        return (
            request.status is RequestStatus.PREEMPTED
            or self.passes.get(request.request_id, 0) >= MAX_PASSES
        )

    def begin(self, running: Iterable[Request]) -> None:
        """Notes the prompt blocks the running requests have still to compute."""
        self._in_flight = set()
        for request in running:
            self.admitted(request)

    def admitted(self, request: Request) -> None:
        """`request` now runs: its blocks still to compute are in flight."""
        size = self.block_manager.block_size
        first, end = request.num_computed_tokens // size, request.num_tokens // size
        if request.num_tokens - request.num_computed_tokens > 1 and end > first:
            self._in_flight.update(self.block_manager.block_hashes(request, end)[first:end])

    def waits(self, request: Request, hit: PrefixHit) -> bool:
        """Whether the request's next block past its cached prefix is being computed by
        a running request (it is then cached by the time the request computes)."""
        if not self._in_flight:
            return False
        size = self.block_manager.block_size
        index = hit.num_tokens // size
        if (index + 1) * size > request.num_tokens:
            return False
        return self.block_manager.block_hashes(request, index + 1)[index] in self._in_flight

    def passed_over(self, queued: list[Request], admitted: Collection[str]) -> None:
        """After an admission pass over `queued` (the waiting queue as it stood): counts a
        pass for every request left waiting that was queued before one admitted, and
        forgets the requests that left the queue."""
        last = max((i for i, r in enumerate(queued) if r.request_id in admitted), default=-1)
        passes: dict[str, int] = {}
        for i, request in enumerate(queued):
            if request.request_id in admitted:
                continue
            count = self.passes.get(request.request_id, 0) + (1 if i < last else 0)
            if count:
                passes[request.request_id] = count
        self.passes = passes

    def _cached_tokens(self, request: Request) -> int:
        return self.block_manager.find_cached_prefix(request, request.num_tokens).num_tokens
