"""Weight-only int8 quantization applied at load (`--quantization int8`).

Every linear layer of every decoder layer (the fused QKV, the attention output, the
fused gate/up and the down projection) holds its matrix as int8 with one float32 scale
per group of GROUP_SIZE consecutive inputs of a row: scale = max |group| / 127,
int8 = round(w / scale), scales of shape [N, K / GROUP_SIZE]. The embedding and the LM
head keep the serving dtype, as in vLLM: the logits are what greedy choices hang on, and
the head is tied to the embedding in the small models this serves on CPU.

The int8 matrices exist before the checkpoint is read; each checkpoint tensor is
quantized as it arrives (one tensor's float copy at a time), so no full-size float copy
of a matrix is ever kept. Groups quantize independently, so under tensor parallelism a
rank reads only its slice: a column-parallel matrix (QKV, gate/up) its output rows with
their scale rows, a row-parallel one (output, down) its input columns, which are whole
groups (`common.model_split.check_int8_groups` refuses a split that would cut one), and
their scales: the whole model's, column for column.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.common.model_split import INT8_GROUP_SIZE
from pdserve.kernels import linear, linear_int8

Tensor = torch.Tensor
SCALES_SUFFIX = "_scales"
# Inputs per scale. 16 keeps the embedded model within float32's quality on the shipped
# eval set where 32 does not (docs/quantization.md), and is one AVX-512 vector.
GROUP_SIZE = INT8_GROUP_SIZE
# Each decoder layer's matrices, as (submodule, parameter prefix).
MATRICES = (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down"))


def project(x: Tensor, weight: Tensor, bias: Tensor | None, scales: Tensor | None) -> Tensor:
    """x @ weight.T (+ bias): an int8 weight with its group scales, or a float one."""
    if scales is None:
        return linear(x, weight, bias)
    return linear_int8(x, weight, scales, bias)


def check_groups(k: int, group_size: int) -> None:
    """Rows of `k` inputs split into whole groups, or a one-line ValueError."""
    if k % group_size:
        raise ValueError(
            f"int8: rows of {k} inputs do not split into groups of {group_size} "
            f"(--quantization int8 needs every matrix's K a multiple of {group_size})"
        )


def quantize_groups(weight: Tensor, group_size: int = GROUP_SIZE) -> tuple[Tensor, Tensor]:
    """int8 weights and their float32 scales [N, K / group_size], one per group of
    `group_size` inputs of a row (an all-zero group gets scale 1)."""
    n, k = weight.shape
    check_groups(k, group_size)
    w = weight.float().view(n, k // group_size, group_size)
    amax = w.abs().amax(dim=2)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(n, k), scales


class Int8Linears:
    """The int8 matrices of one model (a rank's slice, a stage's layers) and how a
    checkpoint tensor lands in them."""

    def __init__(self, layers: nn.ModuleList, group_size: int = GROUP_SIZE):
        self.group_size = group_size
        self.scales_of: dict[int, Tensor] = {}
        for layer in layers:
            for module_name, prefix in MATRICES:
                self._make_int8(getattr(layer, module_name), prefix)

    def _make_int8(self, module: nn.Module, prefix: str) -> None:
        old = getattr(module, f"{prefix}_weight")
        rows, cols = old.shape
        check_groups(cols, self.group_size)  # before any tensor is read
        weight = nn.Parameter(
            torch.empty(old.shape, dtype=torch.int8, device=old.device), requires_grad=False
        )
        scales = nn.Parameter(
            torch.empty(rows, cols // self.group_size, dtype=torch.float32, device=old.device),
            requires_grad=False,
        )
        setattr(module, f"{prefix}_weight", weight)
        setattr(module, prefix + SCALES_SUFFIX, scales)
        self.scales_of[id(weight)] = scales

    def holds(self, param: Tensor) -> bool:
        return id(param) in self.scales_of

    def store(self, tensor: Tensor, param: Tensor, row_offset: int) -> None:
        """Quantizes `tensor` (this rank's slice) into `param`'s rows from `row_offset`
        on, with their scales."""
        q, scales = quantize_groups(tensor, self.group_size)
        rows = q.shape[0]
        param.data[row_offset : row_offset + rows].copy_(q)
        self.scales_of[id(param)].data[row_offset : row_offset + rows].copy_(scales)
