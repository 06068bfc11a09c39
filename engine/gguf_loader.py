"""Fills a built model from a GGUF file, its decoder-layer matrices kept in the file's blocks.

Each decoder layer's matrices (QKV, output, gate/up, down) become `PackedMatrix`es of the
file's blocks with their scales (`engine/models/packed.py`), read with plain reads of exactly
this rank's rows or block-aligned columns (`engine/gguf_file.py`); no float copy of such a
matrix exists at any point. The embedding and an untied LM head stay in the file's
blocks too where it keeps them so (a `PackedMatrix` of one segment: the LM head reads its
blocks, a token's embedding is its row dequantized); tables the file keeps in F32/F16/BF16
are read, a few rows at a time, into the serving dtype's. Norms are read as they are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from pdserve.engine.gguf_file import GGUFError, GGUFFile, GGUFTensor
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.packed import PLAIN, PackedMatrix
from pdserve.engine.models.precision import compute_dtype
from pdserve.kernels.gguf_blocks import dequantize_rows

Tensor = torch.Tensor
# Each fused matrix of a decoder layer: (submodule, parameter prefix) → the tensors it
# holds, in row order (names after "model.layers.N.").
MATRICES = {
    ("attn", "qkv"): (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    ("attn", "o"): ("self_attn.o_proj.weight",),
    ("mlp", "gate_up"): ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    ("mlp", "down"): ("mlp.down_proj.weight",),
}
MATRIX_KEYS = frozenset(key for keys in MATRICES.values() for key in keys)
# The vocabulary tables (Hugging Face name → model attribute), kept in the file's blocks.
TABLES = {"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head"}
ROWS_PER_READ = 256  # rows of a table dequantized at a time: well under a MiB a temporary


def open_gguf(source: Path, device: torch.device | str, quantization: str | None) -> GGUFFile:
    """The GGUF file at `source`, checked before a model is built for it: served on CPU
    (its C kernels), in its own blocks, of block types the kernels read."""
    if quantization is not None:
        raise GGUFError(
            f"{source}: --quantization {quantization} applies to 16/32-bit checkpoints; "
            "a GGUF file is served in its own blocks"
        )
    if torch.device(device).type != "cpu":
        raise GGUFError(f"{source}: GGUF weights are served on CPU (their C kernels), not {device}")
    file = GGUFFile(source)
    file.check_types()
    return file


def load_gguf_weights(file: GGUFFile, model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Fills `model` (`loader.build_model`'s: this rank's slice, this stage's layers) from
    `file`, its tensors' shapes checked first."""
    for name, shape in model.expected_weights():
        found = file.tensor(name).shape
        if found != tuple(shape):
            raise GGUFError(
                f"{file.path}: tensor {name!r} has shape {list(found)}, expected {list(shape)}"
            )
    packed_tables = [
        attr for name, attr in TABLES.items() if _holds(model, attr) and file.tensor(name).packed
    ]
    _narrow_tables(model, dtype, skip=packed_tables)
    weights = GGUFWeights(file, model, compute_dtype(dtype, "cpu"), packed_dtype(dtype))
    for name, attr in TABLES.items():
        if attr in packed_tables:
            setattr(model, attr, weights.packed_table(name))
    weights.load()


def _holds(model: LlamaForCausalLM, attr: str) -> bool:
    return getattr(model, attr) is not None


def packed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype packed matrices decode their weights to when serving `dtype`: bfloat16
    when serving bfloat16 (what a bf16 checkpoint of the same weights computes, the bf16
    dot products' speed), float32 (the exact values) otherwise."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _narrow_tables(model: LlamaForCausalLM, dtype: torch.dtype, skip: list[str]) -> None:
    """The embedding and head tables made in the stored dtype before they are filled, so
    no compute-dtype copy of them exists beside the stored one (those in `skip` stay as
    the file's blocks: their parameter goes)."""
    for name in ("embed", "lm_head"):
        table = getattr(model, name)
        if name in skip:
            delattr(model, name)
            setattr(model, name, None)  # the blocks take its place (`packed_table`)
            continue
        if table is None or table.dtype == dtype:
            continue
        shape = table.shape
        del table
        setattr(model, name, None)  # freed before its replacement is allocated
        # zeros: a last tensor-parallel rank's padding rows stay zero
        setattr(model, name, nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))


class GGUFWeights:
    """Reads one GGUF file into a model: packed matrices, then every other tensor."""

    def __init__(
        self, file: GGUFFile, model: LlamaForCausalLM, compute: torch.dtype, packed: torch.dtype
    ):
        self.file = file
        self.model = model
        self.compute = compute
        self.packed = packed

    def load(self) -> None:
        model = self.model
        for index, layer in zip(
            range(model.stage.layer_start, model.stage.layer_end), model.layers, strict=True
        ):
            for (module_name, prefix), keys in MATRICES.items():
                module = getattr(layer, module_name)
                segments = [self.read_matrix(f"model.layers.{index}.{key}") for key in keys]
                delattr(module, f"{prefix}_weight")  # the float parameter, never filled
                setattr(module, f"{prefix}_weight", PackedMatrix(segments, self.packed))
        for name, _ in model.expected_weights():
            if name in TABLES and isinstance(getattr(model, TABLES[name]), PackedMatrix):
                continue  # set whole from the file's blocks (`packed_table`)
            if name.split(".", 3)[-1] not in MATRIX_KEYS:
                self.copy_rows(name)

    def packed_table(self, name: str) -> PackedMatrix:
        """A table kept in the file's blocks, this rank's rows of it (the LM head's
        products then read a quarter to a half of a bf16 copy's bytes): the last
        tensor-parallel rank's padding rows are zero bytes, which every block type
        decodes to zeros."""
        t = self.file.tensor(name)
        cfg = self.model.cfg
        start, stop, per = self.model.tp.vocab_rows(cfg.vocab_size)
        rows = as_tensor(t, self.file.read_rows(name, start, stop))
        if rows.shape[0] < per:
            rows = torch.cat((rows, rows.new_zeros(per - rows.shape[0], rows.shape[1])))
        return PackedMatrix([(rows, t.qtype)], self.packed)

    def read_matrix(self, name: str) -> tuple[Tensor, int]:
        """This rank's part of a matrix: its rows, or its columns for a row-parallel one."""
        t = self.file.tensor(name)
        shard = self.model.shard_of(name)
        if shard is None:
            array = self.file.read_rows(name)
        elif shard[0] == 0:
            array = self.file.read_rows(name, shard[1], shard[2])
        else:
            array = self.file.read_columns(name, shard[1], shard[2])
        weight = as_tensor(t, array)
        return (weight, t.qtype) if t.packed else (weight.to(self.compute), PLAIN)

    def copy_rows(self, name: str) -> None:
        """A table or vector into its parameter, dequantized a few rows at a time."""
        t = self.file.tensor(name)
        param, offset = self.model.target_of(name)
        shard = self.model.shard_of(name)
        start, stop = (shard[1], shard[2]) if shard is not None else (0, t.shape[0])
        for first in range(start, stop, ROWS_PER_READ):
            last = min(first + ROWS_PER_READ, stop)
            rows = as_tensor(t, self.file.read_rows(name, first, last))
            values = dequantize_rows(rows, t.qtype) if t.packed else rows
            at = offset + first - start
            param.data[at : at + last - first].copy_(values)


def as_tensor(t: GGUFTensor, array: np.ndarray) -> Tensor:
    """The torch view of bytes read from the file (BF16 comes as 16-bit words)."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if t.type_name == "BF16" else tensor
