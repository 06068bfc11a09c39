"""Decoder-layer matrices held as GGUF blocks (Q8_0, Q4_*, Q5_*, K-quants), packed with scales.

A fused matrix of the model (QKV, gate/up) is made of several GGUF tensors, which a file
may store in different types; a `PackedMatrix` holds them as segments of consecutive rows,
each packed (uint8 rows of blocks, `kernels/gguf_blocks.py`) or plain (a tensor the file
keeps in F32/F16/BF16, held in the compute dtype), neighbours of one type merged into one
segment so that a uniform file costs one kernel call per matrix. `project` is the linear
layer for every kind of weight the model classes hold.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.models import int8
from pdserve.engine.models.lanes import LanesMatrix
from pdserve.kernels import gguf_rows, linear, linear_gguf
from pdserve.kernels.gguf_blocks import type_name

Tensor = torch.Tensor
PLAIN = -1  # the qtype of a plain segment


class PackedMatrix(nn.Module):
    """Rows of one matrix as segments: (weight, qtype), in row order. Packed segments
    decode their weights to `weight_dtype`: float32 (the exact values) or bfloat16 (the
    values of a bf16 copy, on the bf16 dot products where the CPU has them)."""

    def __init__(
        self, segments: list[tuple[Tensor, int]], weight_dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        self.weight_dtype = weight_dtype
        self.qtypes: list[int] = []
        merged: list[tuple[Tensor, int]] = []
        for weight, qtype in segments:
            if merged and merged[-1][1] == qtype and merged[-1][0].shape[1:] == weight.shape[1:]:
                merged[-1] = (torch.cat((merged[-1][0], weight)), qtype)
            else:
                merged.append((weight, qtype))
        for i, (weight, qtype) in enumerate(merged):
            self.register_parameter(f"segment{i}", nn.Parameter(weight, requires_grad=False))
            self.qtypes.append(qtype)
        # Looked up once: a decode step makes ~120 of these calls.
        self._segments = [(getattr(self, f"segment{i}"), q) for i, q in enumerate(self.qtypes)]

    def segments(self) -> list[tuple[Tensor, int]]:
        return list(self._segments)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        parts = [
            linear(x, w) if q == PLAIN else linear_gguf(x, w, q, None, self.weight_dtype)
            for w, q in self._segments
        ]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y if bias is None else y + bias

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `ids` of a one-segment matrix (an embedding table) in `dtype`, holding the
        values its products multiply with (`weight_dtype`'s)."""
        if len(self._segments) != 1:
            raise ValueError("row lookups need a matrix of one segment")
        weight, qtype = self._segments[0]
        if qtype == PLAIN:
            return weight[ids].to(self.weight_dtype).to(dtype)
        return gguf_rows(weight, ids, qtype, self.weight_dtype).to(dtype)

    def format_names(self) -> list[str]:
        return [type_name(q) if q != PLAIN else str(w.dtype) for w, q in self.segments()]


def project(
    x: Tensor,
    weight: Tensor | PackedMatrix | LanesMatrix,
    bias: Tensor | None,
    scales: Tensor | None,
) -> Tensor:
    """x @ weight.T (+ bias): a matrix of GGUF blocks, a bf16 one in the lanes layout, an
    int8 one with its per-row scales or a float one."""
    if isinstance(weight, PackedMatrix | LanesMatrix):
        return weight.forward(x, bias)  # no module hooks on this path: skip their cost
    return int8.project(x, weight, bias, scales)


def weight_format(model: nn.Module) -> str:
    """'GGUF Q4_1' (its packed types, most common first) for a model with packed
    matrices, '' for any other."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, PackedMatrix):
            for name in module.format_names():
                counts[name] = counts.get(name, 0) + 1
    if not counts:
        return ""
    return "GGUF " + "/".join(sorted(counts, key=lambda n: -counts[n]))
