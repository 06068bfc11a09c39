"""Tiny GGUF files for the engine tests, written as llama.cpp writes a llama model (Q and K
rows in its interleaved order, matrices quantized by the `gguf` package)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 64, 128, 4, 2, 96, 2
HEAD_DIM = HIDDEN // HEADS
MATRICES = {  # GGUF name (after "blk.N.") → HF shape
    "attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
    "attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
    "ffn_gate.weight": (INTER, HIDDEN),
    "ffn_up.weight": (INTER, HIDDEN),
    "ffn_down.weight": (HIDDEN, INTER),
}


def llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's Q/K rows in llama.cpp's order (each head's halves interleaved)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(
    path: Path, qtype: GGMLQuantizationType, types: dict[str, GGMLQuantizationType] | None = None
) -> Path:
    """A 2-layer llama (hidden 64, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 96) with
    its matrices in `qtype` (or `types[gguf name]`), the embedding Q8_0, norms F32."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    # SmolLM's kind of tokenizer over a toy vocabulary: 94 characters, "ab" and "abc".
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([chr(c) for c in range(0x21, 0x7F)] + ["ab", "abc"])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges(["a b", "ab c"])
    tensors = {"token_embd.weight": rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32)}
    tensors["output_norm.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32)
    for layer in range(LAYERS):
        for name in ("attn_norm.weight", "ffn_norm.weight"):
            tensors[f"blk.{layer}.{name}"] = 1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32)
        for name, shape in MATRICES.items():
            weight = 0.2 * rng.standard_normal(shape, dtype=np.float32)
            if name == "attn_q.weight":
                weight = llama_cpp_rows(weight, HEADS)
            elif name == "attn_k.weight":
                weight = llama_cpp_rows(weight, KV_HEADS)
            tensors[f"blk.{layer}.{name}"] = weight
    for name, array in tensors.items():
        if array.ndim == 1:
            writer.add_tensor(name, array)
            continue
        kind = GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else qtype
        kind = (types or {}).get(name.split(".", 2)[-1], kind)
        writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
