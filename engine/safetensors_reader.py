"""Reads tensors, or row/column ranges of them, from a safetensors file with plain reads.

The safetensors library maps the whole file into memory, and every page a read touches
counts in the process's resident memory until the file is closed: loading a checkpoint
then peaks at about twice its size, and a tensor-parallel rank that needs only columns
of a matrix touches all of its pages. Reading with `pread` into the destination buffer
keeps the peak at the weights the process keeps plus one tensor, and a rank's reads to
exactly its slice.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsReader:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        (size,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        header = json.loads(os.pread(self._fd, size, 8))
        header.pop("__metadata__", None)
        self._entries: dict[str, dict] = header
        self._data_start = 8 + size

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, name: str, shard: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor, or its rows (dim 0) or columns (dim 1) in [start, stop)."""
        entry = self._entries[name]
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} has dtype {entry['dtype']}, which is not supported")
        shape = list(entry["shape"])
        begin = self._data_start + entry["data_offsets"][0]
        item = torch.empty((), dtype=dtype).element_size()
        if shard is None:
            return self._read_into(torch.empty(shape, dtype=dtype), begin)
        dim, start, stop = shard
        row = item
        for size in shape[1:]:
            row *= size
        if dim == 0:  # whole rows: one contiguous range
            out = torch.empty([stop - start, *shape[1:]], dtype=dtype)
            return self._read_into(out, begin + start * row)
        if len(shape) != 2:
            raise ValueError(f"tensor {name!r}: column slices need a matrix, not shape {shape}")
        out = torch.empty([shape[0], stop - start], dtype=dtype)
        for r in range(shape[0]):  # a run of columns per row
            self._read_into(out[r], begin + r * row + start * item)
        return out

    def _read_into(self, out: torch.Tensor, offset: int) -> torch.Tensor:
        # reshape: a 0-d tensor (a per-tensor scale) as one element, no copy
        view = out.reshape(-1).view(torch.uint8).numpy().data.cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise ValueError(f"{self.path}: the file ends inside a tensor")
            done += got
        return out
