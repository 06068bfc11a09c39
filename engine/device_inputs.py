"""Moving a step's small host-side inputs to the device in few asynchronous copies.

The runner builds token ids, positions and attention metadata as CPU tensors (numpy
is fast at that). Copying each from pageable memory would cost one synchronous copy
per tensor; instead the tensors of one dtype are packed into one pinned host buffer
and sent with a single non-blocking copy into a device buffer, and the step gets views
of it. Before packing the next step, the host waits for the previous copy to finish
reading the pinned buffer (normally long done: the sampler synchronises every step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor


class HostToDeviceStager:
    """Views returned by `stage` stay valid until the next `stage` call."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._host: dict[torch.dtype, Tensor] = {}
        self._device: dict[torch.dtype, Tensor] = {}
        self._copied: dict[torch.dtype, torch.cuda.Event] = {}

    def stage(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Device copies of `tensors` (CPU tensors, any shapes), in the same order."""
        totals: dict[torch.dtype, int] = {}
        for t in tensors:
            totals[t.dtype] = totals.get(t.dtype, 0) + t.numel()
        offsets: list[int] = []
        filled: dict[torch.dtype, int] = dict.fromkeys(totals, 0)
        for dtype, total in totals.items():
            self._reserve(dtype, total)
        for t in tensors:
            start = filled[t.dtype]
            self._host[t.dtype][start : start + t.numel()].copy_(t.reshape(-1))
            filled[t.dtype] = start + t.numel()
            offsets.append(start)
        for dtype, total in totals.items():
            self._device[dtype][:total].copy_(self._host[dtype][:total], non_blocking=True)
            if self._pin:
                if dtype not in self._copied:
                    self._copied[dtype] = torch.cuda.Event()
                self._copied[dtype].record()
        return [
            self._device[t.dtype][start : start + t.numel()].view(t.shape)
            for t, start in zip(tensors, offsets, strict=True)
        ]

    def _reserve(self, dtype: torch.dtype, numel: int) -> None:
        """Room for `numel` elements, and the pinned buffer free to overwrite."""
        event = self._copied.get(dtype)
        if event is not None:
            event.synchronize()
        host = self._host.get(dtype)
        if host is not None and host.numel() >= numel:
            return
        size = 1 << max(10, (numel - 1).bit_length())  # grow in powers of two
        self._host[dtype] = torch.empty(size, dtype=dtype, pin_memory=self._pin)
        self._device[dtype] = torch.empty(size, dtype=dtype, device=self.device)
