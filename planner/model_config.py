"""A model's shape from its Hugging Face `config.json`, and its parameter count.

Only the config is read, never the weights: the count comes from the Llama-family
layout (attention projections, a gated MLP or mixture of experts, RMSNorms,
embeddings that may be tied to the output head). Parameters are split into the
linear layers that weight quantization applies to and the rest (embeddings, output
head, norms, biases, routers), which serving stacks keep in 16-bit.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ParameterCount:
    linear: int  # projection weights inside the transformer blocks: quantizable
    other: int  # embeddings, output head, norms, biases, routers: kept 16-bit

    @property
    def total(self) -> int:
        return self.linear + self.other


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    num_experts: int = 0  # 0: dense MLP
    num_experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    torch_dtype: str = "bfloat16"
    model_type: str = "llama"

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        config = config.get("text_config", config) if "num_hidden_layers" not in config else config
        try:
            layers = int(config["num_hidden_layers"])
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            vocab = int(config["vocab_size"])
        except KeyError as missing:
            raise ValueError(f"config.json lacks {missing.args[0]!r}") from None
        model_type = str(config.get("model_type", "llama"))
        experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
        intermediate = int(config.get("intermediate_size") or 4 * hidden)
        return cls(
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=intermediate,
            vocab_size=vocab,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 puts biases on q/k/v without saying so in the config.
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            num_experts=experts,
            num_experts_per_token=int(config.get("num_experts_per_tok") or 0),
            expert_intermediate_size=int(config.get("moe_intermediate_size") or intermediate),
            shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
            model_type=model_type,
        )

    def parameter_count(self) -> ParameterCount:
        h, hd = self.hidden_size, self.head_dim
        q_width = self.num_attention_heads * hd
        kv_width = self.num_kv_heads * hd
        attention = h * q_width + 2 * h * kv_width + q_width * h
        attention_bias = (q_width + 2 * kv_width) if self.attention_bias else 0
        if self.num_experts:
            mlp = self.num_experts * 3 * h * self.expert_intermediate_size
            mlp += 3 * h * self.shared_expert_intermediate_size
            router = h * self.num_experts + (h if self.shared_expert_intermediate_size else 0)
        else:
            mlp = 3 * h * self.intermediate_size
            router = 0
        norms = 2 * h
        embedding = self.vocab_size * h
        output_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        linear = self.num_layers * (attention + mlp)
        other = self.num_layers * (attention_bias + router + norms) + h + embedding + output_head
        return ParameterCount(linear=linear, other=other)


def load_config(path: str) -> dict:
    """`config.json` itself, or the one inside a checkpoint folder."""
    target = Path(path)
    if target.is_dir():
        target = target / "config.json"
    if not target.is_file():
        raise ValueError(f"no config.json at {path}")
    try:
        config = json.loads(target.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{target}: invalid JSON ({exc.msg})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{target}: expected a JSON object")
    return config


def checkpoint_parameter_count(path: str) -> int | None:
    """Parameters stored in a folder's safetensors files, from their headers alone."""
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        with file.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= int(dim)
            total += count
    return total
