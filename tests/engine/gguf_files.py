"""Tiny GGUF files for the engine tests, written as llama.cpp writes a llama model (Q and K
rows in its interleaved order, matrices quantized by the `gguf` package, K-quants by
`tests.engine.kquant_blocks`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from tests.engine.kquant_blocks import KQUANTS, quantize_kquant

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 64, 128, 4, 2, 96, 2


def matrix_shapes(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    """GGUF name (after "blk.N.") → HF shape of each decoder-layer matrix."""
    head_dim = hidden // HEADS
    return {
        "attn_q.weight": (HEADS * head_dim, hidden),
        "attn_k.weight": (KV_HEADS * head_dim, hidden),
        "attn_v.weight": (KV_HEADS * head_dim, hidden),
        "attn_output.weight": (hidden, HEADS * head_dim),
        "ffn_gate.weight": (inter, hidden),
        "ffn_up.weight": (inter, hidden),
        "ffn_down.weight": (hidden, inter),
    }


def quantized(array: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """`array` in `kind`'s blocks: the `gguf` package's quantizer, ours for K-quants."""
    return quantize_kquant(array, kind) if kind in KQUANTS else quantize(array, kind)


def llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's Q/K rows in llama.cpp's order (each head's halves interleaved)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(
    path: Path,
    qtype: GGMLQuantizationType,
    types: dict[str, GGMLQuantizationType] | None = None,
    hidden: int = HIDDEN,
    inter: int = INTER,
    dequantized: bool = False,
) -> Path:
    """A 2-layer llama (hidden 64, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 96; or
    `hidden`, `inter`) with its matrices in `qtype` (or `types[name]`, the name a layer's
    "blk.1.ffn_down.weight" or every layer's "ffn_down.weight", the embedding
    "token_embd.weight": Q8_0 unless named), norms F32. `dequantized`: every matrix written
    as F32 holding the values of its blocks (the same model, unquantized)."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
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
    tensors = {"token_embd.weight": rng.standard_normal((VOCAB, hidden), dtype=np.float32)}
    tensors["output_norm.weight"] = 1 + 0.1 * rng.standard_normal(hidden, dtype=np.float32)
    for layer in range(LAYERS):
        for name in ("attn_norm.weight", "ffn_norm.weight"):
            tensors[f"blk.{layer}.{name}"] = 1 + 0.1 * rng.standard_normal(hidden, dtype=np.float32)
        for name, shape in matrix_shapes(hidden, inter).items():
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
        key = name.split(".", 2)[-1] if name.startswith("blk.") else name
        kind = (types or {}).get(name, (types or {}).get(key, kind))
        blocks = quantized(array, kind)
        if dequantized:
            writer.add_tensor(name, dequantize(blocks, kind))
        else:
            writer.add_tensor(name, blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
