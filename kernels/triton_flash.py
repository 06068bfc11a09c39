"""The flash-attention tile steps the decode and prefill attention kernels share.

Each is a `triton.jit` function the kernels call per key tile; the compiler inlines
them, so a kernel compiles to the same code as with the steps written out in place.
Scores are base 2 (log2(e) is folded into the scale) and all statistics are fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_scores(q, k, scale_log2, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Scores of the query rows against a key tile: [rows, keys]."""
    if UPCAST:
        k = k.to(tl.float32)
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2


@triton.jit
def softmax_step(scores, m_i, l_i, EMPTY_ROWS: tl.constexpr):
    """Online softmax over one more tile: (p, the rescale of what came before, the new
    running max, the new running sum). With EMPTY_ROWS, a row that has seen no key yet
    (all -inf) keeps m = -inf and shifts by 0 instead, which keeps exp2 away from
    (-inf) - (-inf); kernels whose every tile has a visible key per row skip the guard."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    shift = m_new
    if EMPTY_ROWS:
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(scores - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def accumulate_pv(acc, alpha, p, v, cache_ptr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc * alpha + P V for a value tile of the cache behind `cache_ptr`."""
    # P is rounded to the cache dtype as the tensor cores take it.
    p_op = p.to(cache_ptr.dtype.element_ty)
    if UPCAST:
        v = v.to(tl.float32)
        p_op = p_op.to(tl.float32)
    return acc * alpha[:, None] + tl.dot(p_op, v, input_precision=PRECISION)


@triton.jit
def normalize_rows(acc, l_i):
    """The attention output acc / l, and the divisor used: 1 for a row that saw no key
    (l == 0), which so gets zeros."""
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    return acc / safe_l[:, None], safe_l
