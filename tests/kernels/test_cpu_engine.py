"""The engine on the CPU C kernels generates exactly what it generates on the torch
references: tiny random Llama checkpoints (GQA 3:1, head_dim 32; one with a sliding
window), float32, greedy, prompts chunked over cached prefixes beside batched decodes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pdserve.engine.core import EngineCore
from pdserve.engine.synthetic_model import (
    hf_fields,
    random_llama,
    save_checkpoint,
    small_llama_shape,
)
from pdserve.kernels import dispatch
from tests.engine.greedy import greedy_tokens

pytestmark = pytest.mark.slow

CFG = small_llama_shape(
    hidden_size=96, num_attention_heads=6, head_dim=32, max_position_embeddings=256
)


def _write_checkpoint(folder, sliding_window: int | None) -> str:
    # Wide weights spread the logits: greedy never rests on a float near-tie.
    model = random_llama(CFG, torch.float32, "cpu", seed=0, std=0.3)
    arch = "MistralForCausalLM" if sliding_window else "LlamaForCausalLM"
    config = {
        "architectures": [arch],
        "model_type": "mistral" if sliding_window else "llama",
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "sliding_window": sliding_window,
        **hf_fields(CFG, "rope_theta", "rms_norm_eps"),
    }
    return save_checkpoint(model, folder, config)


def _generate(folder: str, prompts: list[list[int]]) -> dict[str, list[int]]:
    engine = EngineCore(
        model=folder, num_kv_blocks=64, max_num_batched_tokens=24, num_threads=2,
        dtype="float32", max_model_len=64 * 16,  # the 64 blocks must hold one full request
    )  # fmt: skip
    tokens = greedy_tokens(engine, prompts, max_tokens=20)
    assert all(len(t) == 20 for t in tokens.values())
    return tokens


@pytest.mark.parametrize("window", [None, 12], ids=["full", "sliding-window"])
def test_greedy_tokens_equal_on_c_kernels_and_references(tmp_path, monkeypatch, window):
    assert dispatch.load_cpu_kernels(), dispatch.cpu_kernels_status()
    calls: Counter[str] = Counter()
    windows = set()
    for name, fn in list(dispatch._CPU.items()):

        def counted(*args, _name=name, _fn=fn, **kwargs):
            calls[_name] += 1
            if _name in ("decode_attention", "prefill_attention"):
                windows.add(args[-2])  # (..., scale, sliding_window, out)
            return _fn(*args, **kwargs)

        monkeypatch.setitem(dispatch._CPU, name, counted)
    folder = _write_checkpoint(tmp_path / "tiny", window)
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, CFG.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 40, 70)
    ]
    with_c = _generate(folder, prompts)
    ran = ("decode_attention", "prefill_attention", "rotary_write_kv_cache", "linear", "rms_norm")
    assert all(calls[name] for name in ran), calls
    assert windows == {window}
    try:
        dispatch.set_cpu_kernels_enabled(False)
        before = sum(calls.values())
        with_references = _generate(folder, prompts)
        assert sum(calls.values()) == before, "the C kernels ran while switched off"
    finally:
        dispatch.set_cpu_kernels_enabled(True)
    assert with_c == with_references
