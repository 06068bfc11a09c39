"""GGUF's block-quantized weight formats in plain torch: their sizes, their dequantization
and the reference of the packed linear layer. Blocks of 32 weights (ggml's Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1) are decoded here, super-blocks of 256 (Q4_K, Q5_K, Q6_K) in `gguf_kquants.py`.

A packed matrix is a uint8 tensor [N, K / block * block bytes]: each row its blocks as
the GGUF file stores them, each block its float16 scale (and Q4_1's and Q5_1's float16
minimum, Q5_0's and Q5_1's fifth bits, a K-quant's sub-block scales) beside its values.
Rows and whole blocks of columns slice without unpacking.
"""

from __future__ import annotations

import torch

from pdserve.kernels.gguf_kquants import KQUANT_TYPES, SUPER_BLOCK, dequantize_kquant_rows

Tensor = torch.Tensor

BLOCK = 32  # weights per block of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
# ggml type number → (name, weights per block, bytes per block).
PACKED_TYPES = {
    8: ("Q8_0", BLOCK, 34),
    2: ("Q4_0", BLOCK, 18),
    3: ("Q4_1", BLOCK, 20),
    6: ("Q5_0", BLOCK, 22),
    7: ("Q5_1", BLOCK, 24),
    **{q: (name, SUPER_BLOCK, size) for q, (name, size) in KQUANT_TYPES.items()},
}
SERVED = ", ".join(name for name, _, _ in PACKED_TYPES.values())


def type_name(qtype: int) -> str:
    return PACKED_TYPES[qtype][0] if qtype in PACKED_TYPES else f"ggml type {qtype}"


def block_weights(qtype: int) -> int:
    """Weights per block of a packed type: a row-parallel slice keeps whole blocks."""
    return PACKED_TYPES[qtype][1]


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one packed row of `k` weights (`k` a multiple of the block)."""
    _, block, size = PACKED_TYPES[qtype]
    return k // block * size


def columns_of(qtype: int, packed_row_bytes: int) -> int:
    """The weights per row of a packed matrix whose rows are `packed_row_bytes` long."""
    _, block, size = PACKED_TYPES[qtype]
    return packed_row_bytes // size * block


def dequantize_rows(packed: Tensor, qtype: int) -> Tensor:
    """float32 [N, K] of a packed uint8 [N, K / block * block bytes], rounded as ggml's
    dequantization: d * q (Q8_0), d * (q - 8) (Q4_0), d * q + m (Q4_1), d * (q - 16)
    (Q5_0), d * q + m (Q5_1), and the K-quants' (`gguf_kquants.dequantize_kquant_rows`)."""
    if qtype not in PACKED_TYPES:
        raise ValueError(f"{type_name(qtype)} is not a packed type (served: {SERVED})")
    if qtype in KQUANT_TYPES:
        return dequantize_kquant_rows(packed, qtype)
    size = PACKED_TYPES[qtype][2]
    n = packed.shape[0]
    blocks = packed.reshape(n, -1, size)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [n, blocks, 1]
    if qtype == 8:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, -1)
    minimum = qtype in (3, 7)  # Q4_1, Q5_1: a float16 minimum after d
    start = 4 if minimum else 2
    raw = blocks[..., start + 4 :] if qtype in (6, 7) else blocks[..., start:]
    # Weight j < 16 is the low nibble of byte j, weight 16 + j its high nibble.
    q = torch.cat((raw & 0x0F, raw >> 4), dim=-1).to(torch.int32)
    if qtype in (6, 7):  # Q5: bit j of the 4 bytes after the scales is weight j's fifth
        high = blocks[..., start : start + 4].to(torch.int32)
        bits = (high[..., :, None] >> torch.arange(8, dtype=torch.int32)) & 1
        q = q | bits.flatten(-2) << 4
    if not minimum:
        return ((q - (8 if qtype == 2 else 16)).float() * d).reshape(n, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (q.float() * d + m).reshape(n, -1)


def gguf_rows_ref(
    weight: Tensor, ids: Tensor, qtype: int, weight_dtype: torch.dtype = torch.float32
) -> Tensor:
    """float32 [*ids.shape, K]: rows `ids` of a matrix of packed rows (`dequantize_rows`),
    each weight rounded to `weight_dtype` (the values a copy in that dtype holds)."""
    flat = ids.reshape(-1)
    rows = dequantize_rows(weight[flat], qtype).to(weight_dtype).float()
    return rows.view(*ids.shape, rows.shape[-1])


def linear_gguf_ref(
    x: Tensor,
    weight: Tensor,
    qtype: int,
    bias: Tensor | None = None,
    weight_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """x @ W.T (+ bias) in float32 for W packed in GGUF blocks of type `qtype` (uint8
    [N, K / block * block bytes]): the packed linear layer, W dequantized whole first.
    `weight_dtype` bfloat16: each weight rounded to bf16 as a bf16 copy of the dequantized
    matrix holds it, the layer then the bf16 linear layer (`reference.linear_ref`)."""
    w = dequantize_rows(weight, qtype).to(weight_dtype).float()
    y = torch.nn.functional.linear(x.float(), w)
    return y if bias is None else y + bias.float()
