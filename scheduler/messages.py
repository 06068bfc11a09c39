"""The wire protocol between the gateway (global scheduler) and the instances.

Tasks go in over ZMQ (gateway → instance); outputs come back batched per step
(instance → gateway). Torch-free msgspec Structs so the gateway, the instances and the
tests share them without importing the engine.
"""

from __future__ import annotations

import msgspec

from scheduler.sampling_params import SamplingParams


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probability of a sampled token and the top alternatives at its position,
    from the model's raw distribution (before penalties and temperature)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RequestDelta(msgspec.Struct):
    """New tokens of one request from one step; `finish_reason` set on its last delta."""

    request_id: str
    new_token_ids: list[int]
    # Index of new_token_ids[0] among the request's output tokens: the gateway orders
    # chunks by it, since the first token (from P) and the rest (from D) race.
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


class InstanceAddress(msgspec.Struct, frozen=True):
    instance_id: str
    role: str  # prefill | decode | colocated
    task_address: str  # ZMQ endpoint the instance pulls tasks from
    kv_address: str = ""  # the instance's KV-transfer handshake endpoint (P and D)


class GenerateTask(msgspec.Struct, tag="generate"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # resolved by the gateway, so P and D sample the same stream
    arrival_time: float  # time.time() at the gateway
    cache_salt: str = ""
    # Prefill role: the decode instance this request is handed to after its first token.
    decode_target: InstanceAddress | None = None


class AbortTask(msgspec.Struct, tag="abort"):
    request_ids: list[str]


Task = GenerateTask | AbortTask


class InstanceStats(msgspec.Struct):
    """Load and cache state the global scheduler routes on (DESIGN.md metric names)."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_remote_kvs: int = 0
    num_held: int = 0
    queued_prefill_tokens: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage_perc: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0


class MetricsDelta(msgspec.Struct):
    """Counter increments and histogram observations since the previous output."""

    counters: dict[str, float] = {}
    histograms: dict[str, list[float]] = {}


class InstanceOutput(msgspec.Struct):
    """One message per step (or per heartbeat interval when idle)."""

    instance: InstanceAddress
    deltas: list[RequestDelta] = []
    stats: InstanceStats | None = None
    metrics: MetricsDelta | None = None
