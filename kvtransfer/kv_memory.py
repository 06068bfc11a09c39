"""One rank's KV storage seen as bytes, for transfers.

The engine stores [num_blocks, num_layers, 2, heads_on_rank, block_size, head_dim]
(engine/kv_cache.py). Here the last two dims become one byte dim, so the dtype no
longer matters and a run of consecutive blocks is one contiguous byte range
(zero-copy send/receive), while a head slice is a strided view that goes through a
contiguous staging buffer when a TP split makes it partial.

Host memory arrives as a torch CPU tensor or a numpy array and is handled as numpy
views of the same memory. CUDA tensors stay torch tensors: UCX takes their
`__cuda_array_interface__` as it is (CUDA IPC / NVLink). A transport that moves host
memory only (zmq) gets CUDA KV through host buffers instead (`host=True`: gathers copy
the blocks out to pinned host memory, receives land in host staging buffers that the
scatter copies in). Device copies run on the transfer's stream and are done before
`gather_runs` and `scatter_runs` return (`device_order.py`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdserve.kvtransfer.device_order import DeviceOrder, order_for
from pdserve.kvtransfer.layout import KVLayoutMismatch
from pdserve.kvtransfer.messages import KVLayout


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch")


class KVMemory:
    def __init__(
        self,
        storage: Any,
        layout: KVLayout,
        tp_size: int = 1,
        num_layers: int | None = None,
        order: DeviceOrder | None = None,
    ):
        """`num_layers`: the layers this rank's storage holds (a pipeline stage's);
        `order`: how its copies are ordered against UCX (by default the one the
        storage's device needs: `device_order.order_for`)."""
        heads = layout.num_kv_heads // tp_size
        layers = num_layers or layout.num_layers
        expected = (layers, 2, heads, layout.block_size, layout.head_dim)
        shape = tuple(storage.shape)
        if len(shape) != 6 or shape[1:] != expected:
            raise KVLayoutMismatch(
                f"KV storage of shape {shape} does not match the layout "
                f"[num_blocks, {', '.join(map(str, expected))}]"
            )
        itemsize = storage.element_size() if _is_torch(storage) else storage.itemsize
        if itemsize != layout.itemsize:
            raise KVLayoutMismatch(
                f"KV storage has {itemsize}-byte elements, layout says {layout.dtype}"
            )
        self.layout = layout
        self.num_blocks = shape[0]
        self.heads = heads
        self.is_cuda = _is_torch(storage) and storage.is_cuda
        row = layout.block_size * layout.head_dim * itemsize
        if _is_torch(storage):
            if not storage.is_contiguous():
                raise ValueError("KV storage must be contiguous")
            raw = storage.view(dtype=_torch_uint8(storage)).reshape(*shape[:4], row)
            self._bytes = raw if self.is_cuda else raw.numpy()
        else:
            if not storage.flags["C_CONTIGUOUS"]:
                raise ValueError("KV storage must be C-contiguous")
            self._bytes = storage.view(np.uint8).reshape(*shape[:4], row)
        self._storage = storage  # keeps the memory alive while transfers use it
        self.order = order if order is not None else order_for(storage)
        self.bytes_per_block = layers * 2 * heads * row

    def check_blocks(self, start: int, count: int) -> None:
        if start < 0 or count < 1 or start + count > self.num_blocks:
            raise IndexError(
                f"blocks [{start}, {start + count}) outside the KV pool of {self.num_blocks}"
            )

    def blocks(self, start: int, count: int) -> Any:
        """Consecutive whole blocks: a contiguous view of the storage itself."""
        self.check_blocks(start, count)
        return self._bytes[start : start + count]

    def gather(self, start: int, count: int, head_lo: int, head_hi: int, host: bool = False) -> Any:
        """A contiguous copy of local heads [head_lo, head_hi) of the given blocks; in
        host memory (a numpy array) with `host`, wherever the storage is."""
        self.check_blocks(start, count)
        view = self._bytes[start : start + count, :, :, head_lo:head_hi]
        if not self.is_cuda:
            return np.ascontiguousarray(view)
        if not host:
            return view.contiguous()
        out = self._pinned(tuple(view.shape))
        out.copy_(view, non_blocking=True)  # done at `gather_runs`' synchronize
        return out.numpy()

    def gather_runs(
        self, runs: list[tuple[int, int]], head_lo: int, head_hi: int, host: bool = False
    ) -> list[Any]:
        """`gather` of each (start, count) run, done when this returns: UCX reads the
        buffers at once, outside any stream."""
        with self.order.copying():
            buffers = [self.gather(start, count, head_lo, head_hi, host) for start, count in runs]
        self.order.mark_copies().synchronize()
        return buffers

    def staging(self, count: int, num_heads: int, host: bool = False) -> Any:
        """An empty contiguous buffer shaped like `gather` output (in host memory with
        `host`)."""
        shape = (count, *self._bytes.shape[1:3], num_heads, self._bytes.shape[4])
        if not self.is_cuda:
            return np.empty(shape, dtype=np.uint8)
        if host:
            return self._pinned(shape).numpy()
        with self.order.copying():  # the stream the scatter out of it runs on
            return self._bytes.new_empty(shape)

    def scatter(self, staging: Any, start: int, head_lo: int, head_hi: int) -> None:
        """Copy a staging buffer (device or host memory) into local heads
        [head_lo, head_hi) of the blocks."""
        count = staging.shape[0]
        self.check_blocks(start, count)
        target = self._bytes[start : start + count, :, :, head_lo:head_hi]
        if not self.is_cuda:
            np.copyto(target, staging)
        elif isinstance(staging, np.ndarray):
            import torch

            target.copy_(torch.from_numpy(staging))
        else:
            target.copy_(staging)

    def _pinned(self, shape: tuple[int, ...]) -> Any:
        """Page-locked host bytes: copies to and from the device run at full speed."""
        import torch

        return torch.empty(shape, dtype=torch.uint8, pin_memory=True)

    def scatter_runs(self, stagings: list[tuple[Any, int]], head_lo: int, head_hi: int) -> None:
        """`scatter` of each (staging buffer, first block), done when this returns: the
        step that reads the blocks is planned after, and UCX may receive into the
        buffers' memory again once they are let go."""
        with self.order.copying():
            for staging, start in stagings:
                self.scatter(staging, start, head_lo, head_hi)
        self.order.mark_copies().synchronize()


def _torch_uint8(tensor: Any) -> Any:
    # Imported only when handed a torch tensor: host-only users need no torch.
    import torch

    return torch.uint8
