"""Weight-only int8 quantization applied at load (`--quantization int8`).

Every linear layer of every decoder layer (the fused QKV, the attention output, the
fused gate/up and the down projection) holds its matrix as int8 with one float32 scale
per output row: scale = max |row| / 127, int8 = round(row / scale). The embedding and
the LM head keep the serving dtype, as in vLLM: the logits are what greedy choices
hang on, and the head is tied to the embedding in the small models this serves on CPU.

The int8 matrices exist before the checkpoint is read; each checkpoint tensor is
quantized row by row as it arrives (one tensor's float copy at a time), so no full-size
float copy of a matrix is ever kept. Rows quantize independently, so a rank's rows of a
column-parallel matrix (QKV, gate/up) and their scales are those of the whole model. A
row-parallel matrix (output, down) splits its input columns: its scales are the whole
rows' and every rank keeps all of them, so a rank reads that tensor whole, quantizes it
and keeps its columns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.kernels import linear, linear_int8

Tensor = torch.Tensor
SCALES_SUFFIX = "_scales"
# Each decoder layer's matrices, as (submodule, parameter prefix).
MATRICES = (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down"))
ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
Shard = tuple[int, int, int] | None


def project(x: Tensor, weight: Tensor, bias: Tensor | None, scales: Tensor | None) -> Tensor:
    """x @ weight.T (+ bias): an int8 weight with its per-row scales, or a float one."""
    if scales is None:
        return linear(x, weight, bias)
    return linear_int8(x, weight, scales, bias)


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """int8 rows and their float32 scales (an all-zero row gets scale 1)."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8), scales


class Int8Linears:
    """The int8 matrices of one model (a rank's slice, a stage's layers) and how a
    checkpoint tensor lands in them."""

    def __init__(self, layers: nn.ModuleList, shard_of: Callable[[str], Shard], tp_enabled: bool):
        self.shard_of = shard_of
        self.tp_enabled = tp_enabled
        self.scales_of: dict[int, Tensor] = {}
        for layer in layers:
            for module_name, prefix in MATRICES:
                self._make_int8(getattr(layer, module_name), prefix)

    def _make_int8(self, module: nn.Module, prefix: str) -> None:
        old = getattr(module, f"{prefix}_weight")
        weight = nn.Parameter(
            torch.empty(old.shape, dtype=torch.int8, device=old.device), requires_grad=False
        )
        scales = nn.Parameter(
            torch.empty(old.shape[0], dtype=torch.float32, device=old.device), requires_grad=False
        )
        setattr(module, f"{prefix}_weight", weight)
        setattr(module, prefix + SCALES_SUFFIX, scales)
        self.scales_of[id(weight)] = scales

    def reads_whole(self, name: str) -> bool:
        """A rank's row-parallel matrix is read whole: its scales need whole rows."""
        return self.tp_enabled and name.endswith(ROW_PARALLEL)

    def read_shard(self, name: str) -> Shard:
        return None if self.reads_whole(name) else self.shard_of(name)

    def holds(self, param: Tensor) -> bool:
        return id(param) in self.scales_of

    def store(self, name: str, tensor: Tensor, param: Tensor, row_offset: int) -> None:
        """Quantizes `tensor`'s rows into `param` from `row_offset` on, with their scales;
        a row-parallel tensor read whole keeps this rank's columns."""
        q, scales = quantize_rows(tensor)
        shard = self.shard_of(name) if self.reads_whole(name) else None
        if shard is not None:  # under TP a row-parallel matrix always has this rank's slice
            _, start, stop = shard
            q = q[:, start:stop]
        rows = q.shape[0]
        param.data[row_offset : row_offset + rows].copy_(q)
        self.scales_of[id(param)].data[row_offset : row_offset + rows].copy_(scales)
