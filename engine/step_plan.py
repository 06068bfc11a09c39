"""What crosses the executor seam: a step's plan in, its sampled tokens out.

The instance (or the offline `LLM`) keeps the step scheduler; the executor's ranks
keep the model, the paged KV cache and a mirror of each running request. Per step the
driver sends one `StepPlan`: requests the ranks have not seen yet in full, every other
scheduled chunk by id with only the block ids added since, the ids whose state the
ranks drop, and the KV connector's metadata. One `StepResult` comes back: the sampled
tokens and each rank's KV-transfer report. Plain msgspec Structs with no tensors, so
the same messages can go to worker processes; torch-free, so a driver and its tests
run without torch.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.common.messages import DroppedFrames, TokenLogprobs
from pdserve.common.sampling_params import SamplingParams


class KVGeometry(msgspec.Struct, frozen=True):
    """One rank's paged KV cache: what the KV-transfer layout is built from."""

    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    block_size: int
    dtype: str  # float32 | bfloat16 | float16 | float8_e4m3fn | float8_e5m2
    num_blocks: int
    # Pipeline parallel: this rank's stage holds layers [first_layer, first_layer +
    # num_layers) of the model's model_layers (0: num_layers, no pipeline).
    first_layer: int = 0
    model_layers: int = 0
    pipeline_stage: int = 0
    pipeline_parallel_size: int = 1
    # An FP8 cache's k_scale and v_scale of every model layer (empty for 16/32 bits).
    k_scales: list[float] = []
    v_scales: list[float] = []

    def bytes_per_token(self, tp_size: int) -> int:
        """KV bytes of one token on the whole instance (`tp_size` ranks of this one's
        heads, every stage's layers): keys and values."""
        itemsize = 1 if self.dtype.startswith("float8") else 4 if self.dtype == "float32" else 2
        layers = self.model_layers or self.num_layers
        return 2 * layers * self.num_kv_heads * tp_size * self.head_dim * itemsize


class WorkerInfo(msgspec.Struct, frozen=True):
    """What a loaded executor reports: the model's facts and the KV cache's size."""

    model_path: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    generation_defaults: dict[str, int | float]
    kernels: str  # which attention/fused-op implementation runs, and why
    kv: KVGeometry
    # Each rank's KV connector endpoint (e.g. its transfer worker's control address).
    connector_addresses: list[str] = []
    # This rank's weights, and how much its resident memory grew while loading them
    # (the peak, KV cache included): what a tensor-parallel split saves per rank.
    weight_bytes: int = 0
    load_peak_memory_bytes: int = 0
    # How the matrices are held when not in the serving dtype, e.g. "GGUF Q4_1".
    weight_format: str = ""
    # The dtype the model computes in (the KV cache's is `kv.dtype`).
    dtype: str = ""


class NewRequest(msgspec.Struct, array_like=True):
    """A request the ranks do not hold yet (first schedule, or again after preemption
    or a failed pull): everything its sampling needs, and its whole block table."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # known already (e.g. the prefill instance's first token)
    sampling_params: SamplingParams
    seed: int


class PlannedChunk(msgspec.Struct, array_like=True):
    """Compute `num_new_tokens` tokens of a request from position `start`."""

    request_id: str
    start: int
    num_new_tokens: int
    new_block_ids: list[int]  # appended to the request's block table on the ranks


class StepPlan(msgspec.Struct):
    # Dropped first: requests that left the compute set (finished, aborted, handed
    # off, preempted). An id may come back as a new request in the same plan.
    finished_ids: list[str] = []
    new_requests: list[NewRequest] = []
    chunks: list[PlannedChunk] = []
    # The KV connector's metadata for this step (opaque to the engine).
    kv_connector: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class SampledToken(msgspec.Struct, array_like=True):
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of prompt tokens [first, first + len(logprobs)) of a request, scored by
    the step that computed the positions before them."""

    request_id: str
    first: int
    logprobs: list[TokenLogprobs]


class StepResult(msgspec.Struct):
    sampled: list[SampledToken] = []
    # Requests that asked for prompt logprobs: those of the prompt positions this step ran.
    prompt_logprobs: list[PromptLogprobs] = []
    # One entry per rank: its KV connector's report (opaque to the engine).
    kv_reports: list[Any] = []
    # Of this step, the seconds the sampling rank spent in tensor-parallel collectives,
    # and the most any rank spent waiting on sends and receives between pipeline stages.
    collective_seconds: float = 0.0
    stage_transfer_seconds: float = 0.0
    # With `collect_model_time`: the sampling rank's seconds in the model's forward (its
    # own layers' under pipeline stages); None when not timed (off, or on CUDA).
    forward_seconds: float | None = None
    # Frames the rank's process dropped since its previous result (its KV control and
    # KV data sockets): a rank process has no output of its own, so its driver counts
    # them in the instance's book (`common/frame_drops.py`).
    dropped_frames: list[DroppedFrames] = []
