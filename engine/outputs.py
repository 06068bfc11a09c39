"""What an instance reports per step: token deltas per request (msgspec, torch-free).

These cross process boundaries (tokens out over ZMQ), so they stay plain msgspec.
"""

from __future__ import annotations

import msgspec


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probability of a sampled token and the top alternatives at its position.

    Computed from the model's raw distribution (before penalties and temperature).
    """

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RequestDelta(msgspec.Struct):
    """New tokens of one request from one step; `finish_reason` set on its last delta."""

    request_id: str
    new_token_ids: list[int]
    # Index of new_token_ids[0] among the request's output tokens (for ordering).
    output_index: int
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
