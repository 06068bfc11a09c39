"""Parses a GGUF file's header: its scalar metadata and its tensor table, arrays skipped.

The `gguf` package's reader makes objects for every item of every array (a vocabulary and
its merges: ~160 MiB resident for a 49k-token file), more than the packed weights a loader
keeps; loading needs only the head counts and where each tensor's bytes are. Layout
(GGUF v2/v3, little-endian): magic, version, tensor count, key/value count; each key/value
as name, type, value; each tensor as name, dims (fastest first), ggml type, offset from
the data section, which starts at the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

# GGUF value type → struct format of its scalars (8: string, 9: array).
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
Scalar = int | float | bool | str


class GGUFHeaderError(ValueError):
    """Not a GGUF file this parser reads (one line)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # as the file lists them: fastest first
    qtype: int
    offset: int  # of its first byte in the file


@dataclass
class GGUFHeader:
    scalars: dict[str, Scalar] = field(default_factory=dict)  # arrays are left out
    tensors: list[TensorInfo] = field(default_factory=list)


def read_header(path: Path) -> GGUFHeader:
    with open(path, "rb") as f:
        return _Parser(f).header()


class _Parser:
    def __init__(self, f: BinaryIO):
        self.f = f

    def header(self) -> GGUFHeader:
        if self.f.read(4) != b"GGUF":
            raise GGUFHeaderError("no GGUF magic at the start")
        (version,) = self._unpack("I")
        if version not in (2, 3):
            raise GGUFHeaderError(f"GGUF version {version} (read: 2, 3)")
        n_tensors, n_kv = self._unpack("QQ")
        out = GGUFHeader()
        for _ in range(n_kv):
            key = self._string()
            (kind,) = self._unpack("I")
            value = self._value(kind)
            if value is not None:
                out.scalars[key] = value
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("I")
            dims = self._unpack("Q" * n_dims)
            qtype, offset = self._unpack("IQ")
            infos.append((name, tuple(dims), qtype, offset))
        alignment = out.scalars.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
            raise GGUFHeaderError(
                f"general.alignment must be a positive integer, got {alignment!r}"
            )
        start = -(-self.f.tell() // alignment) * alignment
        out.tensors = [TensorInfo(n, d, q, start + o) for n, d, q, o in infos]
        return out

    def _unpack(self, fmt: str) -> tuple:
        layout = struct.Struct("<" + fmt)
        data = self.f.read(layout.size)
        if len(data) != layout.size:
            raise GGUFHeaderError("the file ends inside its header")
        return layout.unpack(data)

    def _string(self) -> str:
        (size,) = self._unpack("Q")
        return self.f.read(size).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Scalar | None:
        """A scalar or string; None for an array (skipped)."""
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise GGUFHeaderError(f"unknown GGUF value type {kind}")
        item, count = self._unpack("IQ")
        if item in _SCALARS:  # fixed-size items: one seek
            self.f.seek(count * struct.calcsize("<" + _SCALARS[item]), 1)
        else:
            for _ in range(count):
                self._value(item)
        return None
