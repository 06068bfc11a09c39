"""Llama-shaped models with random weights, built in-process.

The device check (`experiments.gpu_check`) and the engine tests need models of a given
shape without a checkpoint; this module needs nothing beyond torch (no safetensors,
no scheduler), so it runs with a GPU machine's bare Python. `SyntheticLlamaConfig` is a
`pdserve.engine.checkpoint.ModelConfig` with a random Llama's defaults.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.checkpoint import ModelConfig
from pdserve.engine.models.llama import LlamaForCausalLM


@dataclass(frozen=True, kw_only=True)
class SyntheticLlamaConfig(ModelConfig):
    """The shape fields (vocab_size ... max_position_embeddings) are required."""

    architecture: str = "LlamaForCausalLM"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)


# The shape: the fields without a default, named as a Hugging Face config names them.
SHAPE_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(SyntheticLlamaConfig)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)


def hf_fields(cfg: ModelConfig, *more: str) -> dict[str, Any]:
    """cfg's shape and the `more` fields, for a Hugging Face config (same names)."""
    return {name: getattr(cfg, name) for name in (*SHAPE_FIELDS, *more)}


@contextmanager
def building_on(device: torch.device | str, dtype: torch.dtype) -> Iterator[None]:
    """Modules created inside get their parameters in `dtype`, directly on `device`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def small_llama_shape(**changes: Any) -> SyntheticLlamaConfig:
    """Two layers, 4 query / 2 kv heads of 16, vocab 512: small enough for any test or
    dry run; `changes` set other shape (or default) fields."""
    shape: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    return SyntheticLlamaConfig(**{**shape, **changes})


def llama_8b_shape(max_position_embeddings: int = 8192) -> SyntheticLlamaConfig:
    """Llama 3 8B: hidden 4096, 32 layers, 32 query / 8 kv heads of 128, vocab 128256."""
    return SyntheticLlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=max_position_embeddings,
    )


@torch.inference_mode()
def random_llama(
    cfg: SyntheticLlamaConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    std: float = 0.02,
) -> LlamaForCausalLM:
    """Matrices ~ N(0, std²), norm weights 1, biases 0, created directly on `device`.
    A larger `std` spreads the logits apart (fewer near-ties in greedy comparisons)."""
    with building_on(device, dtype):
        model = LlamaForCausalLM(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() == 2:
            param.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)
    return model.eval()


def checkpoint_tensors(model: LlamaForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, a view of the model's parameter) for every checkpoint tensor."""
    for name, shape in model.expected_weights():
        param, offset = model.target_of(name)
        yield name, param[offset : offset + shape[0]]


def save_checkpoint(model: LlamaForCausalLM, folder: Path, config: dict[str, Any]) -> str:
    """A new checkpoint folder holding the model's weights and `config` as config.json."""
    from safetensors.torch import save_file  # here only: the module itself needs just torch

    folder.mkdir()
    tensors = {name: tensor.clone() for name, tensor in checkpoint_tensors(model)}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)
