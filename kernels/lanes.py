"""The lanes layout of a bf16 matrix: W[N, K] stored for `kernels/cpu/linear_lanes.c`.

[ceil(N / 64)][ceil(K / 2)][4][16][2]: per group of 64 outputs and pair of k, four
vectors of 16 outputs' (k, k + 1) weights, rows past N and k past K zero. A product
then keeps each output in one lane of a vector (no horizontal sums), and a group's
weights lie in one contiguous run. Packing happens once, at load.
"""

from __future__ import annotations

import torch

from pdserve.kernels.reference import linear_ref

Tensor = torch.Tensor
GROUP = 64  # outputs per group: four vectors of 16 lanes
LANES = 16


def packed_shape(n: int, k: int) -> tuple[int, ...]:
    """The shape `pack` gives a [n, k] matrix."""
    return (-(-n // GROUP), -(-k // 2), GROUP // LANES, LANES, 2)


def pack(weight: Tensor) -> Tensor:
    """A bf16 [N, K] matrix in the lanes layout (a new contiguous tensor)."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16:
        shape = list(weight.shape)
        raise ValueError(f"lanes.pack: needs a 2-D bfloat16 matrix, got {weight.dtype} {shape}")
    n, k = weight.shape
    groups, pairs = packed_shape(n, k)[:2]
    if (n, k) == (groups * GROUP, pairs * 2):
        padded = weight.contiguous()  # whole groups and pairs already: no padded copy
    else:
        padded = torch.zeros(groups * GROUP, pairs * 2, dtype=torch.bfloat16)
        padded[:n, :k] = weight
    # [g, c, lane, pair, 2] -> [g, pair, c, lane, 2]
    view = padded.view(groups, GROUP // LANES, LANES, pairs, 2)
    return view.permute(0, 3, 1, 2, 4).contiguous()


def rows(packed: Tensor, ids: Tensor, k: int) -> Tensor:
    """Rows `ids` of the matrix `packed` holds, as bf16 [len(ids), k] (an embedding
    lookup on a tied table)."""
    ids = ids.reshape(-1).long()
    picked = packed[ids // GROUP, :, (ids % GROUP) // LANES, ids % LANES, :]  # [n, pairs, 2]
    return picked.reshape(ids.numel(), -1)[:, :k]


def unpack(packed: Tensor, n: int, k: int) -> Tensor:
    """The bf16 [n, k] matrix back (tests, and a path that needs the rows as stored)."""
    groups, pairs = packed.shape[0], packed.shape[1]
    whole = packed.permute(0, 2, 3, 1, 4).reshape(groups * GROUP, pairs * 2)
    return whole[:n, :k].contiguous()


def linear_lanes_ref(
    x: Tensor, packed: Tensor, n: int, bias: Tensor | None = None, out: Tensor | None = None
) -> Tensor:
    """x @ W.T (+ bias) for the W[n, k] that `packed` holds: the plain linear layer on
    the unpacked matrix (the reference the C kernel is tested against)."""
    y = linear_ref(x, unpack(packed, n, x.shape[-1]), bias)
    if out is None:
        return y
    out.copy_(y.view(out.shape))
    return out
