"""Llama-shaped models with random weights, built in-process.

The device check (`experiments.gpu_check`) and the engine tests need models of a given
shape without a checkpoint; this module needs nothing beyond torch (no safetensors,
no scheduler), so it runs with a GPU machine's bare Python. `SyntheticLlamaConfig`
carries the `pdserve.engine.checkpoint.ModelConfig` fields the model reads, under the same
names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class SyntheticLlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"


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
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() == 2:
            param.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)
    return model.eval()
