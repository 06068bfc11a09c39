"""GPU memory arithmetic: weights, KV cache, overheads, and the tensor parallelism needed.

- Weights: quantizable linear layers at the weight dtype's size (BF16/FP16 2 B, FP8 1 B,
  INT8 1 B plus one FP32 scale per 16 inputs as `--quantization int8` stores them,
  0.25 B per weight; INT4 0.5 B plus group metadata: one FP16 scale and one FP16 zero
  point per 128 weights, 0.03125 B per weight); embeddings, output head and norms stay
  16-bit. INT8's scale groups also bound the TP sizes: a rank's slice of a row-parallel
  matrix holds whole groups (serve's rule, `common.model_split.check_int8_groups`).
- KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x KV dtype size.
- Overheads are ranges, not points: the CUDA context, allocator slack and NCCL
  buffers; the activations of the largest batch (hidden states and MLP intermediates of
  the batched tokens, FP32 logits of the sampled rows); CUDA-graph pools.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.model_split import INT8_GROUP_SIZE, Int8GroupError, check_int8_groups
from pdserve.planner.model_config import ModelShape

GIB = 1024**3

DTYPE_BYTES = {
    "float32": 4.0,
    "fp32": 4.0,
    "bfloat16": 2.0,
    "bf16": 2.0,
    "float16": 2.0,
    "fp16": 2.0,
    "half": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}
INT4_GROUP_SIZE = 128
INT4_METADATA_BYTES_PER_GROUP = 4.0  # FP16 scale + FP16 zero point
INT8_METADATA_BYTES_PER_GROUP = 4.0  # one FP32 scale (engine/models/int8.py)
KV_DTYPES = (
    *("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half"),
    *("fp8", "fp8_e4m3", "fp8_e5m2", "int8"),  # `pdserve serve --kv-cache-dtype` has the fp8s
)

RUNTIME_GIB = (0.5, 1.0)  # CUDA context, allocator slack
NCCL_GIB = (0.25, 0.5)  # only with tensor parallelism
CUDA_GRAPH_GIB = (0.1, 0.75)
TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)


def dtype_bytes(dtype: str) -> float:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype '{dtype}': choose one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def bytes_per_weight(dtype: str) -> float:
    """Storage per quantizable weight, metadata included."""
    size = dtype_bytes(dtype)
    if dtype == "int4":
        size += INT4_METADATA_BYTES_PER_GROUP / INT4_GROUP_SIZE
    if dtype == "int8":
        size += INT8_METADATA_BYTES_PER_GROUP / INT8_GROUP_SIZE
    return size


def resolve_dtype(dtype: str, shape: ModelShape) -> str:
    return shape.torch_dtype if dtype == "auto" else dtype


def resolve_kv_dtype(kv_dtype: str, weight_dtype: str) -> str:
    """`auto` keeps the activation dtype: 16-bit unless the weights are FP32."""
    if kv_dtype != "auto":
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV cache dtype '{kv_dtype}': choose {', '.join(KV_DTYPES)}")
        return kv_dtype
    return weight_dtype if dtype_bytes(weight_dtype) >= 2 else "bfloat16"


def weight_bytes(shape: ModelShape, dtype: str) -> float:
    params = shape.parameter_count()
    other_size = 4.0 if dtype_bytes(dtype) == 4.0 else 2.0
    return params.linear * bytes_per_weight(dtype) + params.other * other_size


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, tp: int = 1) -> float:
    """KV bytes one token occupies on one GPU of a TP group."""
    return (
        2 * shape.num_layers * kv_heads_per_gpu(shape, tp) * shape.head_dim * dtype_bytes(kv_dtype)
    )


def kv_heads_per_gpu(shape: ModelShape, tp: int) -> int:
    """KV heads split across TP ranks (serve's rule: `common.model_split.check_tp_size`)."""
    if shape.num_kv_heads % tp == 0:
        return shape.num_kv_heads // tp
    raise ValueError(f"TP {tp} does not divide the {shape.num_kv_heads} KV heads")


def valid_tp_sizes(shape: ModelShape, dtype: str | None = None) -> list[int]:
    """The TP sizes `pdserve serve` can run for this shape: a size that divides the KV
    heads, the attention heads and the MLP width (the same rule as serve's; the planner
    may not import the engine, so it is repeated here and tested against it); with int8
    weights, also one whose rank slices hold whole scale groups."""
    return [
        tp
        for tp in TP_CANDIDATES
        if shape.num_attention_heads % tp == 0
        and shape.num_kv_heads % tp == 0
        and shape.intermediate_size % tp == 0
        and (dtype != "int8" or _int8_groups_fit(shape, tp))
    ]


def _int8_groups_fit(shape: ModelShape, tp: int) -> bool:
    try:
        check_int8_groups(
            tp,
            shape.hidden_size,
            shape.num_attention_heads * shape.head_dim,
            shape.intermediate_size,
        )
    except Int8GroupError:
        return False
    return True


def activation_bytes(
    shape: ModelShape, tp: int, max_batched_tokens: int, max_num_seqs: int
) -> tuple[float, float]:
    """Peak activation memory of one forward, as a (low, high) range per GPU."""
    per_token = 4 * shape.hidden_size + 2 * (
        max(shape.intermediate_size, shape.expert_intermediate_size) // tp
    )
    hidden = max_batched_tokens * per_token * 2.0
    logits = min(max_num_seqs, max_batched_tokens) * shape.vocab_size / tp * 4.0
    low = hidden + logits
    return low, 2 * low


@dataclass(frozen=True)
class MemoryInputs:
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_gib: float = 80.0
    gpu_memory_utilization: float = 0.9

    def validate(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.gpu_memory_gib <= 0 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("GPU memory, --max-num-seqs and batched tokens must be positive")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("--max-model-len must be at least 1")


def memory_at_tp(shape: ModelShape, inputs: MemoryInputs, tp: int) -> dict:
    """Everything about one GPU of a TP group; byte figures in GiB."""
    dtype = resolve_dtype(inputs.dtype, shape)
    kv_dtype = resolve_kv_dtype(inputs.kv_cache_dtype, dtype)
    max_len = inputs.max_model_len or shape.max_position_embeddings
    usable = inputs.gpu_memory_gib * inputs.gpu_memory_utilization * GIB
    weights = weight_bytes(shape, dtype) / tp
    act_low, act_high = activation_bytes(
        shape, tp, inputs.max_num_batched_tokens, inputs.max_num_seqs
    )
    nccl = NCCL_GIB if tp > 1 else (0.0, 0.0)
    overhead_low = (RUNTIME_GIB[0] + nccl[0] + CUDA_GRAPH_GIB[0]) * GIB + act_low
    overhead_high = (RUNTIME_GIB[1] + nccl[1] + CUDA_GRAPH_GIB[1]) * GIB + act_high
    kv_token = kv_bytes_per_token(shape, kv_dtype, tp)
    kv_free_low = max(0.0, usable - weights - overhead_high)  # pessimistic
    kv_free_high = max(0.0, usable - weights - overhead_low)
    tokens_low = int(kv_free_low // kv_token)
    tokens_high = int(kv_free_high // kv_token)
    kv_needed = kv_token * max_len * inputs.max_num_seqs
    return {
        "tp": tp,
        "weight_dtype": dtype,
        "kv_cache_dtype": kv_dtype,
        "max_model_len": max_len,
        "usable_gib": usable / GIB,
        "weights_gib": weights / GIB,
        "overhead_gib": [overhead_low / GIB, overhead_high / GIB],
        "activation_gib": [act_low / GIB, act_high / GIB],
        "kv_bytes_per_token": kv_token,
        "kv_needed_gib": kv_needed / GIB,
        "kv_free_gib": [kv_free_low / GIB, kv_free_high / GIB],
        "kv_capacity_tokens": [tokens_low, tokens_high],
        "max_concurrency_at_max_model_len": [tokens_low // max_len, tokens_high // max_len],
        "fits_one_sequence": tokens_low >= max_len,
        "fits_max_num_seqs": kv_free_low >= kv_needed,
    }


def plan_memory(shape: ModelShape, inputs: MemoryInputs) -> dict:
    """Per-model figures, each valid TP size, and the smallest TP that fits."""
    inputs.validate()
    dtype = resolve_dtype(inputs.dtype, shape)
    kv_dtype = resolve_kv_dtype(inputs.kv_cache_dtype, dtype)
    params = shape.parameter_count()
    per_tp = [memory_at_tp(shape, inputs, tp) for tp in valid_tp_sizes(shape, dtype)]
    one_sequence = next((m["tp"] for m in per_tp if m["fits_one_sequence"]), None)
    full = next((m["tp"] for m in per_tp if m["fits_max_num_seqs"]), None)
    return {
        "parameters": params.total,
        "parameters_linear": params.linear,
        "weight_dtype": dtype,
        "kv_cache_dtype": kv_dtype,
        "weights_gib": weight_bytes(shape, dtype) / GIB,
        "kv_bytes_per_token": kv_bytes_per_token(shape, kv_dtype),
        "kv_gib_per_sequence_at_max_len": kv_bytes_per_token(shape, kv_dtype)
        * (inputs.max_model_len or shape.max_position_embeddings)
        / GIB,
        "per_tp": per_tp,
        "tp_needed_for_one_sequence": one_sequence,
        "tp_needed_for_max_num_seqs": full,
    }
