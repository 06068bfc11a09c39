"""GGUF's block-quantized weight formats (ggml's Q8_0, Q4_0, Q4_1) in plain torch: their
sizes, their dequantization and the reference of the packed linear layer.

A packed matrix is a uint8 tensor [N, K / 32 * block bytes]: each row its K / 32 blocks
as the GGUF file stores them, each block its float16 scale (and Q4_1's float16 minimum)
beside its 32 values. Rows and whole blocks of columns slice without unpacking.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

BLOCK = 32  # weights per block, every packed type
# ggml type number → (name, bytes per block of 32 weights).
PACKED_TYPES = {8: ("Q8_0", 34), 2: ("Q4_0", 18), 3: ("Q4_1", 20)}


def type_name(qtype: int) -> str:
    return PACKED_TYPES[qtype][0] if qtype in PACKED_TYPES else f"ggml type {qtype}"


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one packed row of `k` weights (`k` a multiple of 32)."""
    return k // BLOCK * PACKED_TYPES[qtype][1]


def columns_of(qtype: int, packed_row_bytes: int) -> int:
    """The weights per row of a packed matrix whose rows are `packed_row_bytes` long."""
    return packed_row_bytes // PACKED_TYPES[qtype][1] * BLOCK


def dequantize_rows(packed: Tensor, qtype: int) -> Tensor:
    """float32 [N, K] of a packed uint8 [N, K / 32 * block bytes], rounded as ggml's
    dequantization: d * q (Q8_0), d * (q - 8) (Q4_0), d * q + m (Q4_1)."""
    if qtype not in PACKED_TYPES:
        raise ValueError(f"{type_name(qtype)} is not a packed type (served: Q8_0, Q4_0, Q4_1)")
    size = PACKED_TYPES[qtype][1]
    n = packed.shape[0]
    blocks = packed.reshape(n, -1, size)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [n, blocks, 1]
    if qtype == 8:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, -1)
    raw = blocks[..., 4:] if qtype == 3 else blocks[..., 2:]
    # Weight j < 16 is the low nibble of byte j, weight 16 + j its high nibble.
    q = torch.cat((raw & 0x0F, raw >> 4), dim=-1).to(torch.int32)
    if qtype == 2:
        return ((q - 8).float() * d).reshape(n, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (q.float() * d + m).reshape(n, -1)


def linear_gguf_ref(x: Tensor, weight: Tensor, qtype: int, bias: Tensor | None = None) -> Tensor:
    """x @ W.T (+ bias) in float32 for W packed in GGUF blocks of type `qtype` (uint8
    [N, K / 32 * block bytes]): the packed linear layer, W dequantized whole first."""
    w = dequantize_rows(weight, qtype)
    y = torch.nn.functional.linear(x.float(), w)
    return y if bias is None else y + bias.float()
