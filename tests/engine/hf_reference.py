"""Greedy outputs of Hugging Face transformers: the correctness oracle (fp32)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(folder: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(folder)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
