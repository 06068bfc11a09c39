"""An FP8 KV cache's per-layer scales: read from a checkpoint, set on the model's layers.

vLLM's model: one k_scale and one v_scale per attention layer, stored in the checkpoint
as `model.layers.N.self_attn.k_scale` / `v_scale` (scalar tensors); a layer without
them gets 1.0, vLLM's default. A key is stored as fp8(key / k_scale) and read as
fp8 * k_scale (`kernels/reference.py`). A 16/32-bit cache takes no scale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import nn

from pdserve.engine.checkpoint import CheckpointError
from pdserve.engine.checkpoint_weights import weight_files
from pdserve.engine.gguf_prepare import gguf_source
from pdserve.engine.models.llama import KV_SCALE_NAME
from pdserve.engine.safetensors_reader import SafetensorsReader


class KVScales(msgspec.Struct, frozen=True):
    """Every model layer's scales, by layer index."""

    k: list[float]
    v: list[float]


def read_kv_scales(folder: str | Path, num_layers: int) -> KVScales:
    """The checkpoint's scales, 1.0 where it has none (a GGUF file has none); a scale
    that is not one positive finite number is refused in one line."""
    k, v = [1.0] * num_layers, [1.0] * num_layers
    if gguf_source(folder) is not None:
        return KVScales(k, v)
    found: dict[Path, list[tuple[str, int, str]]] = {}
    for name, path in weight_files(folder).items():
        match = KV_SCALE_NAME.match(name)
        if match is not None and int(match.group(1)) < num_layers:
            found.setdefault(path, []).append((name, int(match.group(1)), match.group(2)))
    for path, names in found.items():
        with SafetensorsReader(path) as reader:
            for name, layer, which in names:
                (k if which == "k" else v)[layer] = _scale(name, reader.read(name, None))
    return KVScales(k, v)


def _scale(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise CheckpointError(f"{name}: a per-tensor KV scale is one value, not {tensor.numel()}")
    value = float(tensor.float().reshape(()))
    if not 0.0 < value < float("inf"):
        raise CheckpointError(f"{name}: a KV scale must be positive and finite, got {value}")
    return value


def set_kv_scales(layers: nn.ModuleList, scales: KVScales) -> None:
    """Each attention layer of this rank's stage writes and reads its cache with its
    layer's scales."""
    for layer in layers:
        attn: Any = layer.attn  # the models' Attention (models/llama.py imports this module)
        i = attn.layer_index
        attn.kv_scales = {"k_scale": scales.k[i], "v_scale": scales.v[i]}
