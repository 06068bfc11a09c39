"""Greedy outputs of Hugging Face transformers: the correctness oracle (fp32)."""

from __future__ import annotations

import functools

import torch

from experiments.hf_greedy import greedy_generate


@functools.lru_cache(maxsize=4)
def hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(folder: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    out = greedy_generate(hf_model(folder), prompt_ids, max_new_tokens)
    return out[0, len(prompt_ids) :].tolist()
