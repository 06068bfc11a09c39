"""Reads a GGUF file: its metadata, its tensor table under Hugging Face names, and a
tensor's bytes (whole, rows, or block-aligned column ranges) with plain reads. Torch-free
(numpy arrays), so the driver checks a file before any instance starts.

The `gguf` package maps the whole file; its tensor views are never touched here, so no
page of tensor data counts in the process's resident memory through that mapping: the
bytes a loader keeps are read with `pread` into their destination (as
`safetensors_reader.py` does for safetensors).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.engine.checkpoint import CheckpointError
from pdserve.engine.embedded import (
    EmbeddedModelError,
    GGUFMetadata,
    hf_tensor_name,
    unpermute_rotary_rows,
)
from pdserve.engine.gguf_header import GGUFHeaderError, read_header

# ggml type number → name of the plain types served (norms, and any matrix a file keeps
# unquantized), with the numpy dtype their bytes are read as (BF16: as 16-bit words).
PLAIN_TYPES = {0: ("F32", np.float32), 1: ("F16", np.float16), 30: ("BF16", np.uint16)}
# ggml type number → (name, weights per block, bytes per block) of the block types the
# kernels multiply packed (`kernels/gguf_blocks.py`, `kernels/cpu/linear_gguf.c`,
# `kernels/cpu/linear_kquant.c`): blocks of 32, and the K-quants' super-blocks of 256.
PACKED_TYPES = {
    8: ("Q8_0", 32, 34),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
SERVED = ", ".join(
    [name for name, _ in PLAIN_TYPES.values()] + [t[0] for t in PACKED_TYPES.values()]
)


class GGUFError(CheckpointError):
    """A GGUF file that cannot be served; the message is one line naming the file."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: where its bytes are and what they hold."""

    gguf_name: str
    qtype: int  # ggml type number
    type_name: str
    shape: tuple[int, ...]  # Hugging Face order: rows first
    offset: int  # of its first byte in the file
    nbytes: int

    @property
    def packed(self) -> bool:
        return self.qtype in PACKED_TYPES

    @property
    def block(self) -> int:
        """Weights per block (1 for a plain type): a column slice keeps whole blocks."""
        return PACKED_TYPES[self.qtype][1] if self.packed else 1

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0]  # a vector's "rows" are its elements


class GGUFFile:
    """The metadata and tensor table of one GGUF file, and plain reads of its tensors."""

    def __init__(self, path: str | Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        try:
            header = read_header(self.path)
        except (GGUFHeaderError, OSError) as exc:
            raise GGUFError(f"{self.path}: not a readable GGUF file: {exc}") from None
        self.scalars = header.scalars
        self.tensors: dict[str, GGUFTensor] = {}
        for t in header.tensors:
            try:
                name = hf_tensor_name(t.name, self.path)
                kind = GGMLQuantizationType(t.qtype)
            except EmbeddedModelError as exc:
                raise GGUFError(str(exc)) from None
            except ValueError:
                raise GGUFError(
                    f"{self.path}: tensor {t.name!r} has unknown ggml type {t.qtype}"
                ) from None
            block, block_bytes = GGML_QUANT_SIZES[kind]
            elements = 1
            for n in t.dims:
                elements *= n
            self.tensors[name] = GGUFTensor(
                gguf_name=t.name,
                qtype=t.qtype,
                type_name=kind.name,
                shape=tuple(reversed(t.dims)),  # GGUF lists dims fastest first
                offset=t.offset,
                nbytes=elements // block * block_bytes,
            )
        self.heads = self._architecture_int("attention.head_count")
        self.kv_heads = self._architecture_int("attention.head_count_kv", self.heads)

    def _architecture_int(self, suffix: str, default: int | None = None) -> int:
        key = f"{self.scalars.get('general.architecture')}.{suffix}"
        value = self.scalars.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GGUFError(
                f"{self.path}: GGUF key {key!r} must be a positive integer, got {value!r}"
            )
        return value

    @functools.cached_property
    def metadata(self) -> GGUFMetadata:
        """Every key, arrays included (the vocabulary: heavy; for writing the folder)."""
        from gguf import GGUFReader

        return GGUFMetadata(GGUFReader(self.path), self.path)

    def check_types(self) -> None:
        """Refuses, in one line naming it, the first tensor of a type not served."""
        for t in self.tensors.values():
            if t.qtype not in PLAIN_TYPES and t.qtype not in PACKED_TYPES:
                raise GGUFError(
                    f"{self.path}: tensor {t.gguf_name!r} is {t.type_name}, which pdserve does "
                    f"not serve (served: {SERVED})"
                )

    def type_names(self) -> list[str]:
        """The types of the file's matrices, most bytes first (e.g. ['Q4_1', 'Q8_0'])."""
        sizes: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.shape) == 2:
                sizes[t.type_name] = sizes.get(t.type_name, 0) + t.nbytes
        return sorted(sizes, key=lambda name: -sizes[name])

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: no tensor for {name!r} in the file")
        return self.tensors[name]

    def read_rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) as the file stores them: uint8 [rows, row bytes] for a
        packed tensor (each row its blocks), else the rows in their dtype; the Q and K
        rows put back into Hugging Face's order (a slice of whole heads)."""
        t = self.tensor(name)
        stop = t.shape[0] if stop is None else stop
        out = np.empty((stop - start) * t.row_bytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            self._read_into(f.fileno(), t.offset + start * t.row_bytes, out)
        return self._unpermuted(name, self._typed(t, out, stop - start), stop - start)

    def read_columns(self, name: str, start: int, stop: int) -> np.ndarray:
        """Columns [start, stop) of every row of a matrix; for a packed one both ends
        must fall on its blocks (32 weights, a K-quant's 256: scales are not split)."""
        t = self.tensor(name)
        per = t.block  # columns per unit of bytes
        if start % per or stop % per:
            raise GGUFError(
                f"{self.path}: tensor {t.gguf_name!r} ({t.type_name}) splits at columns "
                f"{start}:{stop}, not on its {per}-weight blocks: choose a "
                "tensor_parallel_size whose split falls on them"
            )
        unit = t.row_bytes * per // t.shape[1]
        first, width = start // per * unit, (stop - start) // per * unit
        out = np.empty((t.shape[0], width), dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            for r in range(t.shape[0]):  # a run of bytes per row
                self._read_into(f.fileno(), t.offset + r * t.row_bytes + first, out[r])
        return self._typed(t, out.reshape(-1), t.shape[0])

    def _typed(self, t: GGUFTensor, data: np.ndarray, rows: int) -> np.ndarray:
        if not t.packed:
            data = data.view(PLAIN_TYPES[t.qtype][1])
        return data.reshape(rows, -1) if len(t.shape) == 2 else data

    def _unpermuted(self, name: str, rows: np.ndarray, count: int) -> np.ndarray:
        if name.endswith("self_attn.q_proj.weight"):
            heads = count * self.heads // self.tensor(name).shape[0]
        elif name.endswith("self_attn.k_proj.weight"):
            heads = count * self.kv_heads // self.tensor(name).shape[0]
        else:
            return rows
        return np.ascontiguousarray(unpermute_rotary_rows(rows, heads))

    def _read_into(self, fd: int, offset: int, out: np.ndarray) -> None:
        view = out.data.cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise GGUFError(f"{self.path}: the file ends inside a tensor")
            done += got
