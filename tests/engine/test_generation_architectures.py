"""Tiny random checkpoints of each supported architecture, written by transformers,
served by pdserve: greedy tokens equal transformers' own (fp32)."""

from __future__ import annotations

import shutil

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.embedded import embedded_model_path
from tests.engine.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

VOCAB = 49152  # the embedded tokenizer's, copied into each checkpoint
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # Wide weights spread the logits so greedy never rests on a float near-tie.
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
)


def _config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(
            **COMMON,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=12, tie_word_embeddings=False)
    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)
    raise AssertionError(arch)


def _write_checkpoint(tmp_path, arch: str) -> str:
    import transformers as tf

    torch.manual_seed(0)
    cfg = _config(arch)
    cls = {
        "llama": tf.LlamaForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
    }[arch]
    model = cls(cfg).eval()
    folder = tmp_path / arch
    # Small shards: the loader must follow model.safetensors.index.json.
    model.save_pretrained(folder, max_shard_size="2MB")
    embedded = embedded_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded / name, folder / name)
    return str(folder)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_checkpoint_matches_transformers(tmp_path, arch):
    folder = _write_checkpoint(tmp_path, arch)
    assert len(list((tmp_path / arch).glob("*.safetensors"))) > 1
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    # A small token budget splits the prompts into chunks as well.
    llm = LLM(model=folder, dtype="float32", max_num_batched_tokens=16)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(folder, prompt, 24)
