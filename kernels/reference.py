"""Plain-torch references of every kernel in `kernels/`.

These define the semantics. The Triton kernels take the same arguments (the paged-cache
ops take theirs as one bundle of `op_args`) and must agree with these within the
tolerance of the dtype. On CPU the engine runs these.

KV cache layout (one layer): kv_cache[num_blocks, 2, num_kv_heads, block_size, head_dim];
`kv_cache[b, 0]` holds the keys of block b and `kv_cache[b, 1]` its values. The view
may be strided in the block dimension (the engine allocates all layers of a block
together), so nothing here assumes `kv_cache.is_contiguous()`.

Token slots: slot = block_id * block_size + offset_in_block; a negative slot is padding.
Block tables: block_tables[s, i] is the i-th block of sequence s; entries past
ceil(context_len / block_size) are ignored and may hold any valid block id.
Sliding window W: the query at position p sees keys at positions p - W < j <= p.

FP8 KV cache (float8_e4m3fn or float8_e5m2): one k_scale and one v_scale per layer, as
vLLM has them. A key is stored as fp8(key / k_scale), rounded to nearest even and
saturated at the format's largest finite value (never inf/NaN), and read as
float32(fp8) * k_scale; values likewise with v_scale. A 16/32-bit cache takes no scale.
"""

from __future__ import annotations

import torch

from pdserve.kernels.op_args import (
    DecodeAttention,
    PrefillAttention,
    RotaryWriteKV,
    WriteKV,
    output,
    unpacks,
)
from pdserve.kernels.shapes import int8_group_size

Tensor = torch.Tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(kv_cache: Tensor) -> bool:
    return kv_cache.dtype in FP8_DTYPES


def to_fp8(x: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """x / scale in the FP8 dtype: nearest even, saturated at the largest finite value
    (torch's own conversion gives NaN or inf past it)."""
    largest = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-largest, largest).to(dtype)


def _cache_values(x: Tensor, kv_cache: Tensor, scale: float) -> Tensor:
    """x as the cache stores it."""
    return to_fp8(x, scale, kv_cache.dtype) if is_fp8(kv_cache) else x.to(kv_cache.dtype)


def _read(kv: Tensor, scale: float) -> Tensor:
    """Cached keys or values in float32 (an FP8 cache's times its scale)."""
    return kv.float() * scale if kv.dtype in FP8_DTYPES else kv.float()


@unpacks(WriteKV)
def write_kv_cache_ref(op: WriteKV) -> None:
    """Scatter key/value [num_tokens, num_kv_heads, head_dim] into their slots (an FP8
    cache's as fp8(x / scale))."""
    key, value, kv_cache, slot_mapping = op.key, op.value, op.kv_cache, op.slot_mapping
    block_size = kv_cache.shape[3]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    # FP8 through its bytes: indexed writes need no FP8 support of their own.
    target = kv_cache.view(torch.uint8) if is_fp8(kv_cache) else kv_cache
    keys = _cache_values(key, kv_cache, op.k_scale)
    values = _cache_values(value, kv_cache, op.v_scale)
    target[blocks, 0, :, offsets, :] = keys.view(target.dtype)
    target[blocks, 1, :, offsets, :] = values.view(target.dtype)


def _blocks(kv_cache: Tensor, ids: Tensor) -> Tensor:
    """kv_cache[ids] (an FP8 cache's gathered through its bytes)."""
    if is_fp8(kv_cache):
        return kv_cache.view(torch.uint8)[ids].view(kv_cache.dtype)
    return kv_cache[ids]


def _gather_kv(kv_cache: Tensor, block_table: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """Keys and values of one sequence as [num_kv_heads, num_tokens, head_dim]."""
    block_size = kv_cache.shape[3]
    num_blocks = -(-num_tokens // block_size)
    blocks = _blocks(kv_cache, block_table[:num_blocks].long())  # [nb, 2, kvh, bs, d]
    kvh, d = blocks.shape[2], blocks.shape[4]
    kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, kvh, num_blocks * block_size, d)
    return kv[0, :, :num_tokens], kv[1, :, :num_tokens]


def _visible(key_pos: Tensor, query_pos: Tensor, sliding_window: int | None) -> Tensor:
    """Which keys each query sees (the two positions broadcast): causal, and within the
    sliding window W when there is one (p - W < j <= p)."""
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    return visible


@unpacks(DecodeAttention)
def decode_attention_ref(op: DecodeAttention) -> Tensor:
    """One query token per sequence: query [num_seqs, num_heads, head_dim].

    The query is the token at position context_lens[s] - 1 and its own key/value
    are already in the cache.
    """
    query, kv_cache = op.query, op.kv_cache
    num_seqs, num_heads, head_dim = query.shape
    out = output(op)
    if num_seqs == 0:
        return out
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    lens = op.context_lens.long()
    max_len = int(lens.max())
    num_blocks = -(-max_len // block_size)
    # Gather every sequence's blocks at once: [S, nb, 2, kvh, bs, d] -> [S, 2, kvh, nb*bs, d].
    blocks = _blocks(kv_cache, op.block_tables[:, :num_blocks].long())
    kv = blocks.permute(0, 2, 3, 1, 4, 5).reshape(
        num_seqs, 2, num_kv_heads, num_blocks * block_size, head_dim
    )
    keys, values = _read(kv[:, 0], op.k_scale), _read(kv[:, 1], op.v_scale)
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * op.scale  # [S, kvh, g, L]
    positions = torch.arange(num_blocks * block_size, device=query.device)
    # The query is the token at position len - 1.
    visible = _visible(positions[None, :], lens[:, None] - 1, op.sliding_window)
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Slots past a sequence's end may hold anything (even NaN); 0 * NaN would leak.
    values = values.masked_fill(~visible[:, None, :, None], 0.0)
    result = torch.matmul(probs, values).view(num_seqs, num_heads, head_dim)
    out.copy_(result)
    return out


@unpacks(PrefillAttention)
def prefill_attention_ref(op: PrefillAttention) -> Tensor:
    """Ragged causal attention of new tokens over the cached prefix plus themselves.

    query [num_tokens, num_heads, head_dim]; sequence s owns query rows
    query_start_loc[s]:query_start_loc[s+1], which are the last tokens of its
    context_lens[s] tokens (all of whose keys/values are already in the cache).
    """
    query, kv_cache = op.query, op.kv_cache
    out = output(op)
    group = query.shape[1] // kv_cache.shape[2]
    starts = op.query_start_loc.tolist()
    for s, context_len in enumerate(op.context_lens.tolist()):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys, values = _gather_kv(kv_cache, op.block_tables[s], context_len)
        keys = _read(keys, op.k_scale).repeat_interleave(group, dim=0)  # [h, L, d]
        values = _read(values, op.v_scale).repeat_interleave(group, dim=0)
        q = query[q_start:q_end].float().transpose(0, 1)  # [h, q, d]
        scores = torch.matmul(q, keys.transpose(-1, -2)) * op.scale  # [h, q, L]
        q_pos = torch.arange(context_len - q_len, context_len, device=query.device)
        k_pos = torch.arange(context_len, device=query.device)
        visible = _visible(k_pos[None, :], q_pos[:, None], op.sliding_window)
        scores.masked_fill_(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.matmul(probs, values).transpose(0, 1).to(out.dtype)
    return out


def rms_norm_ref(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm as Hugging Face Llama computes it; with `residual`, adds it first and
    returns (normed, x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return normed if residual is None else (normed, residual)


def silu_and_mul_ref(gate_up: Tensor) -> Tensor:
    """The MLP's activation: `silu(gate) * up` of the gate/up projection's two halves."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_embedding_ref(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    """Neox-style rotary embedding over the full head_dim.

    positions [T]; query [T, num_heads, head_dim]; key [T, num_kv_heads, head_dim];
    cos_sin_cache [max_position, head_dim] = cat(cos, sin) of the half-dimension angles.
    Returns new (query, key) in the input dtype.
    """
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions.long()]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def rotate(x: Tensor) -> Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def split_qkv(qkv: Tensor, num_heads: int, kv_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Views of a fused QKV projection's output [T, (num_heads + 2 * kv_heads) * head_dim]
    as query [T, num_heads, d], key and value [T, kv_heads, d] (the cache's kv heads and d)."""
    kv_heads, d = kv_cache.shape[2], kv_cache.shape[4]
    n = qkv.shape[0]
    q, k, v = qkv.split([num_heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return q.view(n, num_heads, d), k.view(n, kv_heads, d), v.view(n, kv_heads, d)


@unpacks(RotaryWriteKV)
def rotary_write_kv_cache_ref(op: RotaryWriteKV) -> Tensor:
    """Rotary embedding of the query and key heads of a fused QKV projection's output,
    then the rotated keys and the values written to their slots (`write_kv_cache_ref`);
    returns the rotated query [T, num_heads, head_dim] in qkv's dtype."""
    query, key, value = split_qkv(op.qkv, op.num_heads, op.kv_cache)
    query, key = rotary_embedding_ref(op.positions, query, key, op.cos_sin_cache)
    write_kv_cache_ref(
        key, value, op.kv_cache, op.slot_mapping, k_scale=op.k_scale, v_scale=op.v_scale
    )
    return query


def linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias in x's dtype; a weight stored narrower (bfloat16 weights of a
    float32-compute model) is widened first."""
    weight = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


def linear_int8_ref(
    x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None = None
) -> Tensor:
    """x @ W.T + bias in x's dtype for an int8 weight quantized in groups of G inputs,
    W[n, k] = weight[n, k] * scales[n, k // G] with scales float32 [N, K / G] (G = K: one
    scale per output row): the weight-only int8 linear layer. W is dequantized in float32,
    the weights the C kernel multiplies by."""
    group = int8_group_size(weight, scales)
    n, k = weight.shape
    w = (weight.float().view(n, k // group, group) * scales[:, :, None]).view(n, k)
    y = torch.nn.functional.linear(x, w.to(x.dtype))
    return y if bias is None else y + bias.to(x.dtype)
