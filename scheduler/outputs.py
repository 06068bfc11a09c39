"""What the step scheduler hands the model runner each step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Request


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
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Requests preempted in this step: their KV is gone and will be recomputed.
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that left the instance since the last step (finished or aborted).
    finished_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
