"""Fused RMSNorm, optionally with the residual add in the same pass.

One program per row. Rounding follows `reference.rms_norm_ref` step by step: the
residual sum is rounded to the input dtype, the statistics are fp32, the normalised
row is rounded to the input dtype before the weight multiplies it, and the result has
the dtype torch would give `weight * x`.
"""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_common import check_float, check_same_device, next_power_of_2

Tensor = torch.Tensor


@triton.jit
def rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols,
        (normed * weight).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _rows(tensor: Tensor, hidden: int) -> Tensor:
    """A 2-D [rows, hidden] view with unit column stride (copying only if it must)."""
    rows = tensor.reshape(-1, hidden)
    return rows if rows.stride(1) == 1 else rows.contiguous()


@overload
def rms_norm_triton(x: Tensor, weight: Tensor, eps: float, residual: None = None) -> Tensor: ...
@overload
def rms_norm_triton(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor
) -> tuple[Tensor, Tensor]: ...
def rms_norm_triton(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """Same contract as `reference.rms_norm_ref`."""
    out, residual_out = rms_norm_outputs(x, weight, residual)
    hidden = x.shape[-1]
    x_rows = _rows(x, hidden)
    out_rows = out.view(-1, hidden)
    if residual is not None and residual_out is not None:
        res_rows = _rows(residual, hidden)
        res_out_rows = residual_out.view(-1, hidden)
    else:
        res_rows = res_out_rows = x_rows  # unused without HAS_RESIDUAL
    num_rows = x_rows.shape[0]
    if num_rows:
        block = next_power_of_2(hidden)
        rms_norm_kernel[(num_rows,)](
            x_rows,
            res_rows,
            weight,
            out_rows,
            res_out_rows,
            eps,
            x_rows.stride(0),
            res_rows.stride(0),
            out_rows.stride(0),
            res_out_rows.stride(0),
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    if residual_out is None:
        return out
    return out, residual_out


@overload
def rms_norm_outputs(x: Tensor, weight: Tensor, residual: None) -> tuple[Tensor, None]: ...
@overload
def rms_norm_outputs(x: Tensor, weight: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]: ...
def rms_norm_outputs(
    x: Tensor, weight: Tensor, residual: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Checks the inputs as a launch does and makes its outputs (the fake implementation
    of the op does the same): the normed rows and, with `residual`, the new residual."""
    check_float("x", x)
    check_float("weight", weight)
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}), "
            f"got {tuple(residual.shape)}, {residual.dtype}"
        )
    check_same_device(x=x, weight=weight, **({} if residual is None else {"residual": residual}))
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        return out, None
    return out, torch.empty_like(x, memory_format=torch.contiguous_format)
