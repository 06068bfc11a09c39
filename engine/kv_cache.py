"""The paged KV cache of one instance (one TP rank).

Memory layout — a decision the transfer path relies on:

    storage[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]

Block-major: every layer's keys and values of one block sit together, so a run of
consecutive block ids is one contiguous byte range and moves between instances as a
single transfer, whatever the number of layers. Each layer sees the view
`storage[:, layer]` of shape [num_blocks, 2, num_kv_heads, block_size, head_dim]
(the per-layer layout, strided in the block dimension), which is what the
attention op in `kernels/` takes. Within a block and layer, one head's tokens are
contiguous (heads before tokens), so a TP rank's heads form contiguous slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPE_SIZES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """2 × layers × kv_heads × head_dim × dtype size."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block


class KVCache:
    """Owns the storage and hands out per-layer views."""

    def __init__(self, shape: KVCacheShape, num_blocks: int, device: torch.device | str = "cpu"):
        if num_blocks < 1:
            raise ValueError(
                f"KV cache memory holds no block of {shape.bytes_per_block} bytes; "
                "raise --kv-cache-memory"
            )
        self.shape = shape
        self.num_blocks = num_blocks
        self.storage = torch.zeros(
            num_blocks,
            shape.num_layers,
            2,
            shape.num_kv_heads,
            shape.block_size,
            shape.head_dim,
            dtype=shape.dtype,
            device=device,
        )
        self.layers = [self.storage[:, layer] for layer in range(shape.num_layers)]

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """The raw bytes of one block across all layers (for transfers and tests)."""
        return self.storage[block_id].view(torch.uint8).reshape(-1)
