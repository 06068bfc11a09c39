"""Locating and reading the safetensors weights of a checkpoint folder offline.

Problems surface as the one-line `CheckpointError` of `pdserve.engine.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.checkpoint import CheckpointError, read_json, require_folder
from pdserve.engine.safetensors_reader import SafetensorsReader


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it, with the index checked against the shards."""
    root = require_folder(folder)
    index_path = root / "model.safetensors.index.json"
    if index_path.is_file():
        return _indexed_weight_files(root, index_path)
    single = root / "model.safetensors"
    files = [single] if single.is_file() else sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no model.safetensors (nor *.safetensors) in the folder")
    located: dict[str, Path] = {}
    for path in files:
        for name in _tensor_shapes(path):
            if name in located:
                raise CheckpointError(
                    f"{path}: tensor {name!r} also appears in {located[name].name}"
                )
            located[name] = path
    return located


def _indexed_weight_files(root: Path, index_path: Path) -> dict[str, Path]:
    index = read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: missing or empty 'weight_map'")
    shards = {}
    for shard in sorted(set(weight_map.values())):
        path = root / str(shard)
        if not path.is_file():
            raise CheckpointError(f"{path}: missing shard named by {index_path.name}")
        shards[shard] = set(_tensor_shapes(path))
    for name, shard in weight_map.items():
        if name not in shards[shard]:
            raise CheckpointError(
                f"{root / shard}: missing tensor {name!r} that {index_path.name} places there"
            )
    return {name: root / shard for name, shard in weight_map.items()}


def _tensor_shapes(path: Path) -> dict[str, list[int]]:
    """Name → shape of every tensor in one file, read from its header alone."""
    try:
        with safe_open(path, framework="pt") as handle:
            return {name: handle.get_slice(name).get_shape() for name in handle.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        reason = _one_line(exc)
        raise CheckpointError(f"{path}: not a readable safetensors file: {reason}") from None


Shard = tuple[int, int, int] | None  # (dim, start, stop) of a tensor to read; None: all


def iter_weights(
    folder: str | Path,
    shard_of: Callable[[str], Shard] | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, one file open at a time; with
    `shard_of`, only the part of each tensor it names is read from the file; with
    `keep`, only the tensors it keeps (a pipeline stage's) are read at all."""
    by_file: dict[Path, list[str]] = {}
    for name, path in weight_files(folder).items():
        if keep is None or keep(name):
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        try:
            with SafetensorsReader(path) as reader:
                for name in names:
                    yield name, reader.read(name, shard_of(name) if shard_of is not None else None)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read tensors: {_one_line(exc)}") from None


def check_shape(
    name: str,
    tensor: torch.Tensor | Sequence[int],
    expected: Sequence[int],
    file: str | Path = "",
) -> None:
    """Raise a one-line CheckpointError when a tensor (or its shape) is not `expected`."""
    actual = list(tensor.shape if isinstance(tensor, torch.Tensor) else tensor)
    if actual != list(expected):
        where = f"{file}: " if file else ""
        raise CheckpointError(
            f"{where}tensor {name!r} has shape {actual}, expected {list(expected)}"
        )


def check_weights(folder: str | Path, expected: Iterable[tuple[str, Sequence[int]]]) -> None:
    """Check, from the file headers alone, that every expected tensor exists with its shape."""
    located = weight_files(folder)
    shapes: dict[Path, dict[str, list[int]]] = {}
    for name, shape in expected:
        path = located.get(name)
        if path is None:
            raise CheckpointError(f"{Path(folder)}: checkpoint lacks tensor {name!r}")
        if path not in shapes:
            shapes[path] = _tensor_shapes(path)
        check_shape(name, shapes[path][name], shape, path)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
