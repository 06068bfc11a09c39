"""GGUF's K-quant super-block formats (ggml's Q4_K, Q5_K, Q6_K) dequantized in plain torch.

A super-block holds 256 weights as 8 sub-blocks of 32 (Q6_K: 16 of 16), each with its
own scale, under one float16 scale for the scales (the layouts: `kernels/cpu/linear_kquant.c`).
Every product below (a float16 times a 6- or 8-bit integer times a value of at most 6
bits) is exact in float32, so the only rounding is Q4_K/Q5_K's subtraction of the minimum:
these are ggml's (and the `gguf` package's) float32 weights to the bit.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

SUPER_BLOCK = 256  # weights per super-block
# ggml type number → (name, bytes per super-block).
KQUANT_TYPES = {12: ("Q4_K", 144), 13: ("Q5_K", 176), 14: ("Q6_K", 210)}


def _half(blocks: Tensor, start: int) -> Tensor:
    """The float16 at byte `start` of each block as float32 [..., 1]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _scales_and_mins(packed: Tensor) -> tuple[Tensor, Tensor]:
    """The 8 six-bit scales and minimums of Q4_K/Q5_K's 12 bytes [..., 12] as int32
    [..., 8]: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums),
    4-7 in the nibbles of bytes 8-11 below the top 2 bits of bytes 0-3 and 4-7."""
    p = packed.to(torch.int32)
    first, second, low = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    scales = torch.cat((first & 63, (low & 15) | (first >> 6) << 4), dim=-1)
    mins = torch.cat((second & 63, (low >> 4) | (second >> 6) << 4), dim=-1)
    return scales, mins


def _nibbles(qs: Tensor) -> Tensor:
    """[..., 4, 32] bytes → [..., 8, 32] values: sub-block 2j the low nibbles of the j-th
    32 bytes, 2j + 1 their high nibbles."""
    return torch.stack((qs & 15, qs >> 4), dim=-2).flatten(-3, -2)


def _with_mins(blocks: Tensor, values: Tensor) -> Tensor:
    """d * scale * q - dmin * min for Q4_K/Q5_K: values int32 [n, blocks, 8, 32]."""
    scales, mins = _scales_and_mins(blocks[..., 4:16])
    a = _half(blocks, 0) * scales.float()
    m = _half(blocks, 2) * mins.float()
    return a[..., None] * values.float() - m[..., None]


def _q4_k(blocks: Tensor) -> Tensor:
    qs = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 32)
    return _with_mins(blocks, _nibbles(qs).to(torch.int32))


def _q5_k(blocks: Tensor) -> Tensor:
    qs = blocks[..., 48:176].reshape(*blocks.shape[:-1], 4, 32)
    high = blocks[..., 16:48].to(torch.int32)  # bit s of byte l: weight l of sub-block s
    bits = torch.arange(8, dtype=torch.int32)[:, None]
    fifth = (high[..., None, :] >> bits) & 1
    return _with_mins(blocks, _nibbles(qs).to(torch.int32) | fifth << 4)


def _q6_k(blocks: Tensor) -> Tensor:
    lead = blocks.shape[:-1]
    # Each half of 128 weights: 64 bytes whose low nibbles are weights 0-63, high 64-127.
    ql = blocks[..., 0:128].reshape(*lead, 2, 64)
    low = torch.stack((ql & 15, ql >> 4), dim=-2).reshape(*lead, 8, 32).to(torch.int32)
    # ... and 32 bytes of 2-bit high parts: bits 2i..2i+1 of byte l for weight 32i + l.
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32).to(torch.int32)
    shifts = torch.arange(0, 8, 2, dtype=torch.int32)[:, None]
    high = ((qh >> shifts) & 3).reshape(*lead, 8, 32)
    q = ((low | high << 4) - 32).reshape(*lead, 16, 16)
    a = _half(blocks, 208) * blocks[..., 192:208].contiguous().view(torch.int8).float()
    return a[..., None] * q.float()


_DEQUANTIZE = {12: _q4_k, 13: _q5_k, 14: _q6_k}


def dequantize_kquant_rows(packed: Tensor, qtype: int) -> Tensor:
    """float32 [N, K] of a packed uint8 [N, K / 256 * super-block bytes] of a K-quant."""
    n = packed.shape[0]
    blocks = packed.reshape(n, -1, KQUANT_TYPES[qtype][1])
    return _DEQUANTIZE[qtype](blocks).reshape(n, -1)
