"""Model definitions, chosen by the checkpoint's `architectures` entry."""

from __future__ import annotations

from pdserve.engine.models.llama import LlamaForCausalLM

# Mistral, Qwen2 and Qwen3 are Llama with config flags (sliding window, qkv bias, q/k norm).
ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(
            f"unsupported architecture {architecture!r} (supported: {supported})"
        ) from None
