"""A plain quantizer into ggml's K-quant super-blocks (Q4_K, Q5_K, Q6_K) for the tests'
GGUF files: the `gguf` package dequantizes these formats but does not quantize them, and
llama.cpp's quantizer is not here. Round-to-nearest on each sub-block's range (no search
for the best scales, as ggml does): valid blocks of a nearby model, not ggml's bytes."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

KQUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
SUPER = 256


def _half_bytes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 of each value [n, 1] as 2 bytes [n, 2], and as float32 back."""
    half = values.astype(np.float16)
    return half.view(np.uint8).reshape(-1, 2), half.astype(np.float32)


def _levels(x: np.ndarray, scale: np.ndarray, top: int) -> np.ndarray:
    """round(x / scale) in [0, top] (x already offset), 0 where the scale is 0."""
    safe = np.where(scale > 0, scale, 1)
    return np.where(scale > 0, np.rint(x / safe), 0).clip(0, top).astype(np.uint8)


def _quantize_with_mins(x: np.ndarray, five_bits: bool) -> np.ndarray:
    """Q4_K (or Q5_K) super-blocks of x [n, 256]: w = d * sc * q - dmin * mn per 32."""
    top = 31 if five_bits else 15
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    step, offset = (sub.max(-1) - low) / top, -low  # [n, 8], both >= 0
    d_bytes, d = _half_bytes(step.max(-1, keepdims=True) / 63)
    dmin_bytes, dmin = _half_bytes(offset.max(-1, keepdims=True) / 63)
    sc, mn = _levels(step, d, 63), _levels(offset, dmin, 63)
    a, m = (d * sc)[..., None], (dmin * mn)[..., None]
    q = _levels(sub + m, a, top)
    scales = np.concatenate(
        [
            (sc[:, :4] & 63) | (sc[:, 4:] >> 4) << 6,
            (mn[:, :4] & 63) | (mn[:, 4:] >> 4) << 6,
            (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4,
        ],
        axis=-1,
    )
    nibbles = (q[:, 0::2] & 15) | (q[:, 1::2] & 15) << 4  # [n, 4, 32]
    parts = [d_bytes, dmin_bytes, scales]
    if five_bits:  # bit s of byte l: the fifth bit of weight l of sub-block s
        fifth = (q >> 4 & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]
        parts.append(np.bitwise_or.reduce(fifth, axis=1))
    parts.append(nibbles.reshape(-1, 128))
    return np.concatenate(parts, axis=-1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks of x [n, 256]: w = d * sc * (q - 32) per 16."""
    groups = x.reshape(-1, 16, 16)
    step = np.abs(groups).max(-1) / 31  # [n, 16]
    d_bytes, d = _half_bytes(step.max(-1, keepdims=True) / 127)
    sc = _levels(step, d, 127)
    a = (d * sc)[..., None]
    safe = np.where(a > 0, a, 1)
    q = (np.where(a > 0, np.rint(groups / safe), 0).clip(-32, 31) + 32).astype(np.uint8)
    halves = q.reshape(-1, 2, 128)
    low = (halves[..., :64] & 15) | (halves[..., 64:] & 15) << 4  # [n, 2, 64]
    top = (halves >> 4).reshape(-1, 2, 4, 32) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    high = np.bitwise_or.reduce(top, axis=2)  # [n, 2, 32]
    return np.concatenate(
        [low.reshape(-1, 128), high.reshape(-1, 64), sc.view(np.uint8), d_bytes], axis=-1
    )


def quantize_kquant(weight: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """uint8 [rows, columns / 256 * block bytes] of a float32 matrix whose rows are whole
    super-blocks, as `gguf.quants.quantize` returns other types."""
    rows, columns = weight.shape
    if columns % SUPER:
        raise ValueError(f"{kind.name} needs whole 256-weight super-blocks, got {columns}")
    x = weight.astype(np.float32).reshape(-1, SUPER)
    if kind == GGMLQuantizationType.Q6_K:
        blocks = _quantize_q6_k(x)
    else:
        blocks = _quantize_with_mins(x, kind == GGMLQuantizationType.Q5_K)
    return np.ascontiguousarray(blocks.astype(np.uint8).reshape(rows, -1))
