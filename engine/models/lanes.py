"""A bf16 model's matrices on CPU held in the lanes layout (`kernels/lanes.py`), packed once
after loading, where the C kernels run bf16 dot products.

The layout keeps each output in one vector lane through the whole sum over k, so a product
pays no horizontal sum per output and a decode step streams each matrix as contiguous
runs; every row count (decode, prefill, any batch) runs the same kernel, so a token's
outputs still do not depend on what shares its step. A tied embedding table is packed
once and serves both the head and its row lookups.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.kernels import dispatch, lanes, linear_lanes

if TYPE_CHECKING:
    from pdserve.engine.models.llama import LlamaForCausalLM

Tensor = torch.Tensor
log = logging.getLogger(__name__)


class LanesMatrix(nn.Module):
    """One bf16 matrix W[n, k] in the lanes layout."""

    def __init__(self, weight: Tensor):
        super().__init__()
        self.n, self.k = int(weight.shape[0]), int(weight.shape[1])
        self.packed = nn.Parameter(lanes.pack(weight), requires_grad=False)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.shape[-1] != self.k:  # an odd K's packing has room for one feature more
            raise ValueError(f"x has {x.shape[-1]} features, the matrix expects {self.k}")
        return linear_lanes(x, self.packed, self.n, bias)

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `ids` (an embedding lookup) in `dtype`; an id past the rows is an
        IndexError, as in an embedding (the padding rows would read as zeros)."""
        if ids.numel() and (int(ids.max()) >= self.n or int(ids.min()) < 0):
            raise IndexError(f"row ids must be in [0, {self.n})")
        return lanes.rows(self.packed, ids, self.k).to(dtype)


MATRICES = (
    ("attn", "qkv_weight"),
    ("attn", "o_weight"),
    ("mlp", "gate_up_weight"),
    ("mlp", "down_weight"),
)


def pack_matrices(model: LlamaForCausalLM) -> int:
    """Every bf16 matrix the model multiplies by (the decoder layers', the head or the
    tied table) packed, where the CPU kernels take bf16 dot products; how many."""
    kernels = dispatch.cpu_kernels()
    if kernels is None or not kernels.bf16_dot:
        return 0
    packed = 0
    for layer in model.layers:
        for part, name in MATRICES:
            module = getattr(layer, part)
            weight = getattr(module, name)
            if _packable(weight):
                _replace(module, name, LanesMatrix(weight.data))
                packed += 1
    head = "lm_head" if model.lm_head is not None else "embed"
    weight = getattr(model, head)
    if (model.norm is not None) and _packable(weight):  # the last stage: it holds the head
        _replace(model, head, LanesMatrix(weight.data))
        packed += 1
    log.info("%d bf16 matrices packed for the bf16 dot-product kernels", packed)
    return packed


def _replace(module: nn.Module, name: str, matrix: nn.Module) -> None:
    delattr(module, name)  # a parameter's name takes no module until it is gone
    setattr(module, name, matrix)


def _packable(weight: object) -> bool:
    return (
        isinstance(weight, Tensor)
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_cpu
    )
