"""The wire protocol between the gateway (global scheduler) and the instances.

Tasks go in over ZMQ (gateway → instance); outputs come back batched per step
(instance → gateway). Torch-free msgspec Structs so the gateway, the instances and the
tests share them without importing the engine.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import msgspec

from pdserve.common.block_events import BlockCacheSnapshot
from pdserve.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probability of a sampled token and the top alternatives at its position,
    from the model's raw distribution (before penalties and temperature)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class KVPullTimes(msgspec.Struct, array_like=True):
    """A decode instance's pull of one request's KV as its ranks timed it (wall clock,
    `time.time()` seconds, over every rank: the first receive posted, the last byte in)."""

    started: float
    ended: float
    num_bytes: int
    transport: str  # the transport that moved it: ucx, ucx-listener, zmq
    num_blocks: int = 0  # blocks pulled (the driver's count: local prefix hits not pulled)


class ModelTime(msgspec.Struct, array_like=True):
    """Seconds of the model steps one request was part of on one instance (each step's
    whole time counts for every request in it, as vLLM counts it): `forward` the
    model's forward (logits included) on the sampling rank, None where it was not
    timed (a CUDA device: timing it would need a synchronize); `execute` the step as
    the driver ran it (its plan and the executor call: the trip to the ranks and back,
    forward and sampling; not the scheduler's own schedule and update)."""

    forward: float | None = 0.0
    execute: float = 0.0


class InstanceTimings(msgspec.Struct, array_like=True):
    """When one request's phases happened on one instance, on that instance's wall clock
    (`time.time()` seconds; the gateway reconciles clocks: `gateway/clock_sync.py`). Sent
    once, with the request's last delta from the instance (a prefill instance's: its
    first token); None where a phase never happened there."""

    queued: float  # its task (a handoff) reached this instance: its queue starts
    first_scheduled: float | None = None  # first given a chunk, or its remote blocks
    kv_ready: float | None = None  # decode side: its pulled KV usable
    first_token: float | None = None  # first token sampled here
    last_token: float | None = None  # latest token sampled here
    kv_pull: KVPullTimes | None = None
    # Each preemption: lost its blocks → scheduled again (its decode splits there).
    preemptions: list[tuple[float, float]] = []
    # With model detail on (`EngineConfig.collect_model_time`): the model time of its
    # steps before its first token here, and of each decode stretch after it (split
    # where it was preempted, in order).
    prefill_model: ModelTime | None = None
    decode_model: list[ModelTime] = []


class RequestDelta(msgspec.Struct):
    """New tokens of one request from one step; `finish_reason` set on its last delta."""

    request_id: str
    new_token_ids: list[int]
    # Index of new_token_ids[0] among the request's output tokens: the gateway orders
    # chunks by it, since the first token (from P) and the rest (from D) race.
    output_index: int
    logprobs: list[TokenLogprobs] | None = None
    # With the first output token, when asked for: the logprobs of prompt tokens 1..n-1
    # (the first token has none), from the instance that computed the prompt.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # Set on the error delta of a request whose step failed on this instance, which
    # dropped it: the gateway sends it elsewhere instead of failing it. STEP_SUSPECT: it
    # may be the cause (a strike against it); STEP_BYSTANDER: another request on
    # probation here was (no strike).
    step_failed: str = ""
    # On the request's last delta from this instance (a prefill instance's: the first
    # token): when its phases happened here, for the gateway's timeline and traces.
    timings: InstanceTimings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


STEP_SUSPECT = "suspect"
STEP_BYSTANDER = "bystander"


def error_delta(
    request_id: str, message: str, num_prompt_tokens: int = 0, output_index: int = 0
) -> RequestDelta:
    """The last delta of a request an instance could not run or finish."""
    return RequestDelta(
        request_id=request_id,
        new_token_ids=[],
        output_index=output_index,
        finish_reason="error",
        num_prompt_tokens=num_prompt_tokens,
        error=message,
    )


class InstanceAddress(msgspec.Struct, frozen=True):
    instance_id: str
    role: str  # prefill | decode | colocated
    task_address: str  # ZMQ endpoint the instance pulls tasks from


class AddressedTask(msgspec.Struct, kw_only=True):
    """What every task of the gateway's names: the epoch of the instance it is meant for,
    as the gateway believes it current (`InstanceView.epoch`, stamped as the task leaves:
    `Dispatcher._send`). The instance drops a task for another of its epochs
    (`instance/task_epochs.py`)."""

    epoch: int = 0


class GenerateTask(AddressedTask, tag="generate"):
    request_id: str
    prompt_token_ids: list[int]
    # Its seed is always set (by the gateway), so P and D sample the same stream.
    sampling_params: SamplingParams
    arrival_time: float  # time.time() at the gateway
    cache_salt: str = ""
    # Prefill role: the decode instance this request is handed to after its first token.
    decode_target: InstanceAddress | None = None
    # Its epoch as the gateway routed to it: the prefill instance's hold of the blocks
    # names it, and the control messages of any other life of it are dropped there.
    decode_epoch: int = 0
    # A migrated request (its instance died mid-stream): the output tokens the client
    # already has. The instance computes prompt + these and samples from the next output
    # index on, so penalties, stop checks and seeded sampling go on as if nothing happened.
    # Sent only to an instance that runs the request to its end (never with decode_target).
    output_token_ids: list[int] = []
    # Instances on which a step with this request failed (the gateway's count): above 0
    # the request is on probation, run there one such request at a time, and a second
    # failed step ends it (`instance/probation.py`).
    step_failures: int = 0


class AbortTask(AddressedTask, tag="abort"):
    request_ids: list[str]
    # Decode side: handoffs of these requests from this prefill instance that have not
    # arrived yet are void (P may have sent one just before it heard of the abort). A
    # retry comes from another prefill instance, so it is not mistaken for a late one.
    handoffs_from: str = ""


class SnapshotTask(AddressedTask, tag="snapshot"):
    """Asks for a `BlockCacheSnapshot` in the next output: the gateway missed block
    events (PUB/SUB drops messages before a subscription is up and when it falls
    behind), so it resyncs from a snapshot that travels on the reliable output path."""


class InspectTask(AddressedTask, tag="inspect"):
    """Asks for an `InstanceInspection` in the next output (tests and debugging)."""

    query_id: str


class LeakBlocksTask(AddressedTask, tag="leak_blocks"):
    """Test hook: hold blocks for a request the scheduler does not know, so a test can
    prove the invariant check catches a leak. Honoured only by instances started with
    test hooks enabled."""

    num_blocks: int = 1
    owner: str = "leaked-on-purpose"


class FailStepsTask(AddressedTask, tag="fail_steps"):
    """Test hook: from now on every step fails (`every_step`), or every step while a
    request whose prompt starts with `prompt_prefix` is on the instance; the defaults
    turn it off. Honoured only by instances started with test hooks enabled."""

    every_step: bool = False
    prompt_prefix: list[int] = []


class SwitchRoleTask(AddressedTask, tag="switch_role"):
    """The instance takes `role` once the requests it holds are done (the gateway sends
    it nothing new meanwhile), keeping its weights, KV cache and process; its next
    output announces the switch (`InstanceOutput.switched`) in the epoch after the one
    the task names."""

    role: str


Task = (
    GenerateTask
    | AbortTask
    | SnapshotTask
    | InspectTask
    | LeakBlocksTask
    | FailStepsTask
    | SwitchRoleTask
)


class InstanceStats(msgspec.Struct):
    """Load and cache state the global scheduler routes on."""

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
    num_kv_transfers_in_flight: int = 0  # prefill and decode kinds: pulls with data moving
    # Decode kind: the latest handoffs whose pull ended (at most decode/pull_outcomes.py's
    # window), how many of them were recomputed here because the pull failed, and the
    # latest failure among them ("" if none).
    kv_pulls_recent: int = 0
    kv_pulls_recomputed: int = 0
    kv_pull_last_failure: str = ""


class DroppedFrames(msgspec.Struct, frozen=True):
    """Frames one channel of the instance's process dropped for one reason
    (`common/frame_drops.py`), since the previous report."""

    channel: str
    reason: str
    count: int


class MetricsDelta(msgspec.Struct):
    """Counter increments and histogram observations since the previous output."""

    counters: dict[str, float] = {}
    histograms: dict[str, list[float]] = {}
    # KV bytes each rank of the instance moved since the previous output, by rank index
    # (`kv_transfer_bytes_total` is their sum).
    rank_kv_bytes: dict[int, float] = {}
    dropped_frames: list[DroppedFrames] = []


class InstanceInspection(msgspec.Struct):
    """An instance's books, for the invariant "idle ⇒ every block free or cached"."""

    query_id: str
    invariant_error: str | None  # the first broken scheduler invariant, if any
    block_owners: dict[int, list[str]]  # block id → requests holding it (held blocks only)
    num_total_blocks: int
    num_free_blocks: int  # free plus cached-unreferenced
    num_cached_blocks: int
    unfinished_request_ids: list[str]  # waiting, running, pulling or held here


class InstanceOutput(msgspec.Struct):
    """One message per step (or per heartbeat interval when idle)."""

    instance: InstanceAddress
    deltas: list[RequestDelta] = []
    stats: InstanceStats | None = None
    metrics: MetricsDelta | None = None
    inspection: InstanceInspection | None = None
    block_snapshot: BlockCacheSnapshot | None = None
    # The instance's life as the gateway numbers it (`InstanceSpec.epoch`: 0 at launch,
    # a replacement's is past every retired one): outputs of a retired epoch are dropped.
    epoch: int = 0
    # Turns the step loop has completed (it turns at least every `idle_wait_s`, idle or
    # not): heartbeats come from the I/O thread, so this tells a loop that progresses
    # (however long its steps) from one that hangs while the I/O thread lives on.
    loop_turns: int = 0
    # Why the instance cannot serve though its loop turns (its circuit breaker tripped:
    # `instance/breaker.py`); the gateway then fences it like a stalled one.
    unhealthy: str = ""
    # The instance's wall clock as the output was made: the gateway's receipt bounds the
    # instance's clock offset from above (`gateway/clock_sync.py`).
    sent_at: float = 0.0
    # Set once, in the output that ends a role switch: the instance as it serves now
    # (its new role, in `epoch`), for the gateway to move it to the other pool.
    switched: InstanceInfo | None = None


class InstanceInfo(msgspec.Struct, frozen=True):
    """What a ready instance tells its launcher, and the launcher the gateway."""

    address: InstanceAddress
    events_address: str  # ZMQ PUB endpoint of its block events (BlockEventBatch frames)
    model_path: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    # generation_config.json sampling defaults (its own key names), for the gateway.
    generation_defaults: dict[str, int | float] = {}
    pid: int = 0
    # Which attention/fused-op implementation runs (C kernels, Triton or the torch
    # references, and why), so operators see a missing fast path at startup.
    kernels: str = ""
    # What the startup summary names: the model's dtype and the engine's device.
    dtype: str = ""
    device: str = ""
    # The KV cache's dtype (e.g. float8_e4m3fn) and its bytes per token, every rank's.
    kv_cache_dtype: str = ""
    kv_bytes_per_token: int = 0
    # Where an FP8 cache's scales come from ("measured at load", "the checkpoint's",
    # "1.0"); "" for a 16/32-bit cache.
    kv_scales: str = ""
    # Bytes of the weights a rank holds, and how they are quantized ("" for none).
    weight_bytes: int = 0
    quantization: str = ""
    # The epoch its outputs start in (a restarted instance: its predecessor's last + 1).
    epoch: int = 0


def decoded(decoder: msgspec.msgpack.Decoder[T], payload: bytes, what: str) -> T | None:
    """The message, or None (logged) where it is malformed: a receiver drops the frame and
    goes on."""
    try:
        return decoder.decode(payload)
    except msgspec.DecodeError as exc:
        logger.warning("dropping a malformed %s: %s", what, exc)
        return None
