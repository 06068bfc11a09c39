"""Whether a request may join an instance's step scheduler at all: checked once, when it
is added, so a request that can never run is refused at once with a one-line reason."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.common.request import Request
from pdserve.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from pdserve.scheduler.step_scheduler import Scheduler


def max_kv_tokens_of(request: Request, config: SchedulerConfig) -> int:
    """The most tokens whose KV the request can need: the last token sampled is
    never computed, and generation stops at max_tokens or max_model_len."""
    max_tokens = request.sampling_params.max_tokens
    final = config.max_model_len
    if max_tokens is not None:
        final = min(final, request.num_prompt_tokens + max_tokens)
    return max(request.num_tokens, final - 1)


def check_admissible(request: Request, max_kv_tokens: int, scheduler: Scheduler) -> None:
    """Raises ValueError: a duplicate id, an empty or too long prompt, or more KV than
    the whole pool holds."""
    rid, cfg = request.request_id, scheduler.config
    if rid in scheduler.requests or rid in scheduler.quarantined:
        raise ValueError(f"request {rid} is already scheduled on this instance")
    if not request.prompt_token_ids:
        raise ValueError(f"request {rid}: the prompt is empty")
    if request.num_tokens > cfg.max_model_len:
        raise ValueError(
            f"request {rid}: {request.num_tokens} tokens exceed max_model_len ({cfg.max_model_len})"
        )
    needed = scheduler.block_manager.blocks_for(max_kv_tokens)
    if needed > cfg.num_blocks:
        raise ValueError(
            f"request {rid}: up to {max_kv_tokens} tokens need {needed} KV blocks, "
            f"more than the pool's {cfg.num_blocks} (lower max_tokens or grow the cache)"
        )
