"""transformers' greedy generation, the reference the engine tests and the bf16 accuracy
run compare pdserve against."""

from __future__ import annotations

from typing import Any

import torch


def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, **options: Any) -> Any:
    """transformers' greedy generation of one unpadded prompt (`options`: generate's)."""
    with torch.inference_mode():
        return model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **options,
        )
