"""A program of C kernel calls: recorded once through the ops' own bindings, run again
and again as one call (kernels/cpu/program.c).

`CpuProgram.recorder()` gives the kernels with every op's call recorded rather than made;
calling ops on it checks and packs their arguments exactly as a call made now would, and
the outputs it returns are the buffers the program writes when run. The tensors an op
reads and writes must therefore outlive the program: the recorder's caller holds them.
"""

from __future__ import annotations

import ctypes

from pdserve.kernels.cpu_fields import BoundCall, error_message
from pdserve.kernels.cpu_ops import CpuKernels


class CpuProgram:
    """The recorded calls, in order; `run` makes them all in one call into C."""

    def __init__(self, kernels: CpuKernels):
        self._kernels = kernels
        self._calls: list[ctypes.Array[ctypes.c_int64]] = []
        self._addresses: list[int] = []
        self._ops: ctypes.Array[ctypes.c_int64] | None = None
        self._args: ctypes.Array[ctypes.c_int64] | None = None

    def recorder(self) -> CpuKernels:
        """The kernels, with each op's call appended to this program instead of made."""
        return self._kernels.recording(self)

    def append(self, call: BoundCall, args: ctypes.Array[ctypes.c_int64]) -> None:
        if self._ops is not None:
            raise RuntimeError("this program is sealed: record into a new one")
        self._calls.append(args)
        self._addresses.append(call.address)

    def __len__(self) -> int:
        return len(self._calls)

    def seal(self) -> None:
        """Ends the recording: the op list C walks is fixed from here on."""
        ops = (ctypes.c_int64 * (2 * len(self._calls)))()
        for i, (address, args) in enumerate(zip(self._addresses, self._calls, strict=True)):
            ops[2 * i] = address
            ops[2 * i + 1] = ctypes.addressof(args)
        self._ops = ops
        self._args = self._kernels.program_call.pack(ctypes.addressof(ops), len(self._calls))

    def run(self) -> None:
        """Makes every call in order; the first that fails raises its own one-line
        ValueError (the one a call made from Python raises)."""
        if self._args is None:
            self.seal()
        assert self._args is not None  # seal() packed it
        rc = self._kernels.program_call.invoke(self._args)
        if rc:
            op = self._args[-1]
            raise ValueError(error_message(rc, self._calls[op][-1]))
