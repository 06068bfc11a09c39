"""transformers' `generate` on the same random model: the device check's baseline.

Optional: where transformers is not installed, or its API does not fit, the check
prints why and goes on without the column.
"""

from __future__ import annotations

import time

import torch

from pdserve.engine.synthetic_model import (
    SyntheticLlamaConfig,
    building_on,
    checkpoint_tensors,
    hf_fields,
)


def build_hf_llama(model: torch.nn.Module, cfg: SyntheticLlamaConfig, dtype, device):
    """A transformers Llama holding `model`'s weights (Hugging Face tensor names)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    same = hf_fields(cfg, "rms_norm_eps", "rope_theta", "tie_word_embeddings")
    config = LlamaConfig(**same, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with building_on(device, dtype):
        hf = LlamaForCausalLM(config)
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, tensor in checkpoint_tensors(model):
            params[name].copy_(tensor)
    return hf.eval()


def _generate_seconds(hf, prompt: torch.Tensor, new_tokens: int) -> float:
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sync()
    began = time.perf_counter()
    with torch.inference_mode():
        hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    sync()
    return time.perf_counter() - began


def generate_step_ms(
    model: torch.nn.Module,
    cfg: SyntheticLlamaConfig,
    dtype: torch.dtype,
    batches: list[int],
    context: int,
    steps: int,
) -> dict[int, float | str]:
    """Per-step milliseconds of `generate` at each batch size, prompts of `context`
    tokens: (time of 1 + steps new tokens - time of 1) / steps, so prefill cancels."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("  transformers not installed: no baseline column")
        return {}
    device = next(model.parameters()).device
    try:
        hf = build_hf_llama(model, cfg, dtype, device)
    except Exception as exc:  # an API drift must not hide the engine's figures
        print(f"  transformers baseline unavailable: {type(exc).__name__}: {exc}")
        return {}
    gen = torch.Generator().manual_seed(0)
    results: dict[int, float | str] = {}
    for batch in batches:
        prompt = torch.randint(0, cfg.vocab_size, (batch, context), generator=gen).to(device)
        try:
            _generate_seconds(hf, prompt[:, :8], 2)  # warm-up
            first = _generate_seconds(hf, prompt, 1)
            more = _generate_seconds(hf, prompt, 1 + steps)
            results[batch] = max(0.0, more - first) / steps * 1e3
        except Exception as exc:
            print(f"  transformers generate failed at batch {batch}: {type(exc).__name__}: {exc}")
            results[batch] = "failed"
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results
