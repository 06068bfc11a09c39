"""A checkpoint folder for the device check's served and split sections, written on the
machine itself: a random Llama (`pdserve.engine.synthetic_model`) saved as
model.safetensors + config.json, beside a word-level tokenizer whose words are "w0",
"w1", ... (one per token id), so a prompt is text and every sampled id detokenizes.

`pdserve serve --model FOLDER` and `pdserve.LLM(model=FOLDER)` take the folder as they
take any Hugging Face checkpoint folder; nothing of the embedded model is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pdserve.engine.synthetic_model import (
    SyntheticLlamaConfig,
    hf_fields,
    random_llama,
    save_checkpoint,
    small_llama_shape,
)

UNKNOWN = "[UNK]"  # id 0
EOS_ID = 2


def model_shape(dry_run: bool) -> SyntheticLlamaConfig:
    """Small enough to load in seconds; whole GQA groups so it splits over 2 ranks."""
    if dry_run:
        return small_llama_shape(max_position_embeddings=512)
    return SyntheticLlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=4096,
    )  # fmt: skip


def word(token_id: int) -> str:
    return UNKNOWN if token_id == 0 else f"w{token_id}"


def prompt_text(token_ids: list[int]) -> str:
    return " ".join(word(i) for i in token_ids)


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {word(i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": word(EOS_ID), "unk_token": UNKNOWN, "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_checkpoint(folder: Path, cfg: SyntheticLlamaConfig) -> str:
    """A new folder holding the model (float32, random, wide weights so greedy rests on
    no near-tie) and its tokenizer; returns its path."""
    model = random_llama(cfg, torch.float32, "cpu", seed=0, std=0.3)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": EOS_ID,
        **hf_fields(cfg, "rms_norm_eps", "rope_theta", "tie_word_embeddings"),
    }  # fmt: skip
    path = save_checkpoint(model, folder, config)
    write_tokenizer(folder, cfg.vocab_size)
    return path
