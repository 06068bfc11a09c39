"""Rotary position tables: the cos/sin cache that `kernels.rotary_embedding` reads."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair angular frequencies, computed in float32 the way Hugging Face does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "llama3" and scaling is not None:
        return _llama3_frequencies(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, llama3)")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1 keeps high frequencies, divides low ones by `factor`, and blends between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict | None
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of the angles, then their sin."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)
