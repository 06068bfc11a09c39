"""What the step scheduler hands the model runner each step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.request import Request


@dataclass
class ScheduledChunk:
    """Compute `num_new_tokens` tokens of `request` starting at `start`.

    `start` is the request's num_computed_tokens when it was scheduled; the tokens are
    `request.tokens_between(start, start + num_new_tokens)`. A token is sampled after
    the chunk when it reaches the end of the request's known tokens.
    """

    request: Request
    start: int
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table, enough for start + num_new_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        return self.end == self.request.num_tokens


@dataclass
class RemoteKVAllocation:
    """Decode side: blocks now allocated for a handed-off request's remote KV.

    The first `num_local_cached_tokens` tokens were found in the local prefix cache
    (their blocks already hold the KV); the rest must be pulled from the prefill
    instance into `missing_block_ids`, then `Scheduler.finish_remote_kvs` called.
    """

    request_id: str
    block_ids: list[int]  # covers all num_remote_tokens tokens
    num_remote_tokens: int
    num_local_cached_tokens: int  # a multiple of block_size
    block_size: int

    @property
    def missing_block_ids(self) -> list[int]:
        return self.block_ids[self.num_local_cached_tokens // self.block_size :]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Requests preempted in this step: their KV is gone and will be recomputed.
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that left the compute set since the last step (finished, aborted, or —
    # prefill side — handed off with their blocks held): drop their per-request state.
    finished_ids: list[str] = field(default_factory=list)
    # Decode side: requests that entered WAITING_FOR_REMOTE_KVS in this step. They are
    # not computed, so a step can carry allocations and still be `is_empty`.
    remote_kv_allocations: list[RemoteKVAllocation] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SchedulerStats:
    """A snapshot for metrics (vLLM's names without the prefix)."""

    num_running: int
    num_waiting: int
    num_waiting_for_remote_kvs: int
    num_held: int  # prefill side: handed off, blocks held for the decode side
    kv_cache_usage_perc: float  # 0..1; cached-unreferenced blocks count as free
    num_preemptions_total: int
    prefix_cache_queries_total: int  # tokens
    prefix_cache_hits_total: int  # tokens
