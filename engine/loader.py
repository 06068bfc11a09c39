"""Builds a model from a checkpoint folder in the requested dtype."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.checkpoint import ModelConfig
from pdserve.engine.checkpoint_weights import check_weights, iter_weights
from pdserve.engine.gguf_prepare import gguf_source
from pdserve.engine.models import model_class
from pdserve.engine.models.lanes import pack_matrices
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.precision import compute_dtype, store_matrices_narrow
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.pipeline import PipelineStage


def load_model(
    folder: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp: TensorParallel | None = None,
    stage: PipelineStage | None = None,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """With `tp`, the rank's slice of the model, read as slices from the files; with
    `stage`, only the tensors of the stage's layers (and ends) are read; with
    `quantization="int8"`, the decoder layers' matrices held as int8 with per-group scales,
    quantized as their tensors are read (`engine/models/int8.py`). A folder prepared for a
    GGUF file (`engine/gguf_prepare.py`) reads that file's blocks (`engine/gguf_loader.py`)."""
    source = gguf_source(folder)
    gguf = None
    if source is not None:  # checked before the model is built
        from pdserve.engine.gguf_loader import load_gguf_weights, open_gguf

        gguf = open_gguf(source, device, quantization)
    model = build_model(config, dtype, device, tp, stage)
    compute = compute_dtype(dtype, device)
    if gguf is not None:
        load_gguf_weights(gguf, model, dtype)
    else:
        # Shapes and presence are checked from the file headers before any tensor is read.
        check_weights(folder, model.expected_weights())
        if quantization == "int8":
            model.quantize_int8()
        model.load_weights(iter_weights(folder, model.shard_of, model.holds))
    if compute != dtype:
        store_matrices_narrow(model, dtype)
        if gguf is None:  # bf16 on CPU (int8 layers keep theirs; the head is bf16)
            pack_matrices(model)
    return model.eval()


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp: TensorParallel | None = None,
    stage: PipelineStage | None = None,
) -> LlamaForCausalLM:
    """The model's modules with their parameters allocated, not filled."""
    cls = model_class(config.architecture)
    previous = torch.get_default_dtype()
    # Parameters are created directly in the compute dtype...
    torch.set_default_dtype(compute_dtype(dtype, device))
    try:
        with torch.device(device):  # ...and on the serving device: no host copy of the model
            return cls(config, tp, stage)
    finally:
        torch.set_default_dtype(previous)
