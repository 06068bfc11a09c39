"""Settings of one instance's step scheduler and block manager."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("fcfs", "lpm")


@dataclass(kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # requests running (or pulling KV) at once
    max_num_batched_tokens: int = 2048  # tokens computed per step, all requests together
    max_model_len: int  # prompt + output tokens of one request
    block_size: int = 16  # tokens per KV block
    num_blocks: int  # KV blocks in the pool
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Admission order of waiting requests: "fcfs", arrival order, or "lpm", the longest
    # cached prefix first (see prefix_order.py).
    scheduling_policy: str = "fcfs"
    # Block events wait here until drained; past this many they are dropped and the
    # sequence skips a number, so subscribers resync from a snapshot.
    max_pending_block_events: int = 100_000

    def __post_init__(self) -> None:
        checks = [
            (self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}"),
            (
                self.max_num_batched_tokens >= 1,
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}",
            ),
            (
                self.max_model_len >= 1,
                f"max_model_len must be at least 1, got {self.max_model_len}",
            ),
            (self.block_size >= 1, f"block_size must be at least 1, got {self.block_size}"),
            (self.num_blocks >= 1, f"num_blocks must be at least 1, got {self.num_blocks}"),
            (
                self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be at least max_model_len ({self.max_model_len})",
            ),
            (
                self.scheduling_policy in SCHEDULING_POLICIES,
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}",
            ),
            (
                self.max_pending_block_events >= 1,
                "max_pending_block_events must be at least 1",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
