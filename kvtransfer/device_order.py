"""The order between a rank's CUDA work on its KV cache and UCX.

UCX reads and writes device memory itself (CUDA IPC, NVLink, GPUDirect), outside every
CUDA stream, while kernels return before they run. So a buffer goes to UCX only once
the kernels that write it are done, and what UCX wrote reaches the cache by a copy that
is done before the step that reads it is launched:

- `mark_compute()`, on the rank's compute thread when a step's plan brings holds or
  pulls: a marker after every kernel launched so far on that thread's stream (the steps
  that wrote the held blocks, or last used the blocks a pull receives into). The
  transfer I/O thread waits on it before it takes those holds and pulls in.
- `copying()`: gathers (a head slice out of the cache, for a send) and scatters (a
  received slice into the cache) run on the transfer's own stream, beside the step's;
  `mark_copies()` then marks them, and the I/O thread waits on that marker before it
  hands a gathered buffer to UCX, and before it reports a scattered pull finished (the
  decode step that reads the blocks is planned only after that report; the staging
  buffer is let go only then too, so UCX never receives into memory a copy still reads).

Host memory needs none of it: numpy copies and torch's CPU ops are done when they
return (`HostOrder`).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Protocol


class Marker(Protocol):
    def synchronize(self) -> None:
        """Blocks the calling thread until the work marked is done."""
        ...


class DeviceOrder(Protocol):
    def mark_compute(self) -> Marker:
        """A marker after the work launched so far on the calling thread's stream."""
        ...

    def copying(self) -> AbstractContextManager[Any]:
        """The scope in which gathers, scatters and staging buffers use the transfer's
        stream."""
        ...

    def mark_copies(self) -> Marker:
        """A marker after the copies launched so far on the transfer's stream."""
        ...


class _Done:
    def synchronize(self) -> None:
        pass


class HostOrder:
    """Host memory: every copy and every step is done when its call returns."""

    def mark_compute(self) -> Marker:
        return _Done()

    def copying(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def mark_copies(self) -> Marker:
        return _Done()


class CudaOrder:
    """CUDA events on the compute thread's current stream and on a transfer stream."""

    def __init__(self, device: Any) -> None:
        import torch

        self._cuda = torch.cuda
        self._device = device
        self._stream = torch.cuda.Stream(device)

    def mark_compute(self) -> Marker:
        event = self._cuda.Event()
        event.record(self._cuda.current_stream(self._device))
        return event

    def copying(self) -> AbstractContextManager[Any]:
        return self._cuda.stream(self._stream)

    def mark_copies(self) -> Marker:
        event = self._cuda.Event()
        event.record(self._stream)
        return event


def order_for(storage: Any) -> DeviceOrder:
    """CUDA events for a CUDA tensor, nothing for host memory (torch CPU or numpy)."""
    if type(storage).__module__.startswith("torch") and storage.is_cuda:
        return CudaOrder(storage.device)
    return HostOrder()
