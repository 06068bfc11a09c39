"""Checkpoint folders: config parsing per architecture, weights single and sharded, and the
one-line errors for every way a folder can be broken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.engine.checkpoint import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    GenerationConfig,
    ModelConfig,
    load_generation_config,
    load_model_config,
)
from pdserve.engine.checkpoint_weights import check_shape, check_weights, iter_weights, weight_files

BASE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def write_config(folder: Path, architecture: str = "LlamaForCausalLM", **overrides) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [architecture], **BASE, **overrides}
    config = {k: v for k, v in config.items() if v is not ...}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def random_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 48, generator=g),
    }


def write_sharded(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 2) -> dict:
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def assert_one_line(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# ---- config.json ------------------------------------------------------------------------------


def test_llama_config_defaults_follow_transformers(tmp_path: Path) -> None:
    cfg = ModelConfig.from_folder(write_config(tmp_path))
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.num_key_value_heads == 4  # defaults to the number of heads
    assert cfg.head_dim == 8  # hidden / heads
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 10000.0
    assert cfg.rope_scaling is None and cfg.sliding_window is None
    assert cfg.max_position_embeddings == 2048
    assert not cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert cfg.torch_dtype == "float32" and cfg.eos_token_ids == []


def test_config_fields_read_from_the_file(tmp_path: Path) -> None:
    folder = write_config(
        tmp_path,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        attention_bias=True,
        torch_dtype="bfloat16",
        bos_token_id=7,
        eos_token_id=[8, 9],
    )
    cfg = load_model_config(folder)
    assert (cfg.num_key_value_heads, cfg.head_dim) == (2, 16)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (1e-5, 5e5, 4096)
    assert cfg.tie_word_embeddings and cfg.attention_bias and cfg.o_proj_bias
    assert cfg.torch_dtype == "bfloat16"
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (7, [8, 9])


def test_architecture_flags(tmp_path: Path) -> None:
    qwen2 = ModelConfig.from_folder(write_config(tmp_path / "q2", "Qwen2ForCausalLM"))
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    assert qwen2.sliding_window is None and qwen2.max_position_embeddings == 32768
    qwen2_window_off = write_config(
        tmp_path / "q2w", "Qwen2ForCausalLM", sliding_window=4096, use_sliding_window=False
    )
    assert ModelConfig.from_folder(qwen2_window_off).sliding_window is None
    qwen3 = ModelConfig.from_folder(write_config(tmp_path / "q3", "Qwen3ForCausalLM", head_dim=16))
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 16
    mistral = ModelConfig.from_folder(
        write_config(tmp_path / "m", "MistralForCausalLM", sliding_window=4096)
    )
    assert mistral.sliding_window == 4096 and not mistral.attention_bias
    no_window = write_config(tmp_path / "m2", "MistralForCausalLM", sliding_window=None)
    assert ModelConfig.from_folder(no_window).sliding_window is None


def test_transformers_5_rope_parameters(tmp_path: Path) -> None:
    folder = write_config(
        tmp_path,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        dtype="bfloat16",
    )
    cfg = ModelConfig.from_folder(folder)
    assert cfg.rope_theta == 500000.0 and cfg.torch_dtype == "bfloat16"
    assert cfg.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    default = write_config(tmp_path / "d", rope_scaling={"type": "default"})
    assert ModelConfig.from_folder(default).rope_scaling is None


@pytest.mark.slow  # importing transformers alone takes several seconds
def test_config_matches_transformers_reading_of_the_same_file(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cases = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }
    for arch, config_class in cases.items():
        folder = tmp_path / arch
        config_class(**BASE, num_key_value_heads=2, architectures=[arch]).save_pretrained(folder)
        ours = ModelConfig.from_folder(folder)
        theirs = config_class.from_pretrained(folder)
        assert ours.architecture == arch
        assert ours.head_dim == (getattr(theirs, "head_dim", None) or 32 // 4)
        assert ours.num_key_value_heads == theirs.num_key_value_heads == 2
        assert ours.rms_norm_eps == theirs.rms_norm_eps
        assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
        assert ours.max_position_embeddings == theirs.max_position_embeddings
        assert ours.tie_word_embeddings == theirs.tie_word_embeddings
        expected_window = theirs.sliding_window if arch == "MistralForCausalLM" else None
        assert ours.sliding_window == expected_window


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, ["'GPT2LMHeadModel'", *SUPPORTED_ARCHITECTURES]),
        ({"architectures": ...}, ["architectures"]),
        ({"hidden_size": ...}, ["'hidden_size'"]),
        ({"vocab_size": "many"}, ["'vocab_size'", "positive integer"]),
        ({"num_key_value_heads": 3}, ["multiple"]),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["'yarn'", "llama3"]),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["low_freq_factor"]),
        ({"hidden_act": "gelu"}, ["gelu"]),
        ({"eos_token_id": "two"}, ["eos_token_id"]),
    ],
)
def test_bad_config_is_one_line_naming_the_file(
    tmp_path: Path, overrides: dict, fragments: list[str]
) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], **BASE, **overrides}
    config = {k: v for k, v in config.items() if v is not ...}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        ModelConfig.from_folder(folder)
    assert_one_line(error, "config.json", *fragments)


def test_missing_folder_missing_config_and_malformed_json(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as error:
        ModelConfig.from_folder(tmp_path / "nowhere")
    assert_one_line(error, "nowhere", "no such checkpoint folder")
    with pytest.raises(CheckpointError) as error:
        ModelConfig.from_folder(tmp_path)
    assert_one_line(error, "config.json", "missing")
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],\n  oops}')
    with pytest.raises(CheckpointError) as error:
        ModelConfig.from_folder(tmp_path)
    assert_one_line(error, "config.json", "malformed JSON", "line 2")
    assert isinstance(error.value, ValueError)


# ---- generation_config.json -------------------------------------------------------------------


def test_generation_config(tmp_path: Path) -> None:
    assert GenerationConfig.from_folder(tmp_path) == GenerationConfig()
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 5, "temperature": 0.6, "top_p": 0.9, "do_sample": True})
    )
    gen = load_generation_config(tmp_path)
    assert gen.eos_token_ids == [5]
    assert gen.defaults == {"temperature": 0.6, "top_p": 0.9}
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [1, 2],
                "top_k": 20,
                "min_p": 0.05,
                "repetition_penalty": 1.1,
                "max_new_tokens": 256,
                "transformers_version": "5.0",
            }
        )
    )
    gen = GenerationConfig.from_folder(tmp_path)
    assert gen.eos_token_ids == [1, 2]
    assert gen.defaults == {
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_new_tokens": 256,
    }
    (tmp_path / "generation_config.json").write_text('{"top_p": "high"}')
    with pytest.raises(CheckpointError) as error:
        GenerationConfig.from_folder(tmp_path)
    assert_one_line(error, "generation_config.json", "'top_p'")


# ---- weights ----------------------------------------------------------------------------------


def test_single_file_weights_round_trip(tmp_path: Path) -> None:
    tensors = random_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = dict(iter_weights(tmp_path))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)


def test_sharded_weights_round_trip(tmp_path: Path) -> None:
    tensors = random_tensors(seed=1)
    write_sharded(tmp_path, tensors, shards=3)
    files = weight_files(tmp_path)
    assert {path.name for path in files.values()} == {
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    }
    loaded = dict(iter_weights(tmp_path))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    write_sharded(tmp_path, random_tensors(), shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as error:
        list(iter_weights(tmp_path))
    assert_one_line(error, "model-00002-of-00002.safetensors", "missing shard")


def test_tensor_listed_by_the_index_but_absent_from_its_shard(tmp_path: Path) -> None:
    index = write_sharded(tmp_path, random_tensors(), shards=2)
    index["weight_map"]["model.layers.1.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as error:
        weight_files(tmp_path)
    assert_one_line(error, "model-00001-of-00002.safetensors", "model.layers.1.mlp.up_proj.weight")


def test_no_weights_and_corrupt_weights(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as error:
        list(iter_weights(tmp_path))
    assert_one_line(error, "no model.safetensors")
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(CheckpointError) as error:
        list(iter_weights(tmp_path))
    assert_one_line(error, "model.safetensors", "not a readable safetensors file")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError) as error:
        list(iter_weights(tmp_path))
    assert_one_line(error, "model.safetensors.index.json", "weight_map")


def test_shape_checks_name_tensor_file_expected_and_actual(tmp_path: Path) -> None:
    tensors = random_tensors()
    write_sharded(tmp_path, tensors, shards=2)
    expected = {name: tuple(t.shape) for name, t in tensors.items()}
    check_weights(tmp_path, expected.items())  # all present and right: no error
    wrong = dict(expected, **{"model.norm.weight": (33,)})
    with pytest.raises(CheckpointError) as error:
        check_weights(tmp_path, wrong.items())
    shard = weight_files(tmp_path)["model.norm.weight"].name
    assert_one_line(error, shard, "'model.norm.weight'", "[32]", "[33]")
    missing = dict(expected, **{"lm_head.weight": (64, 32)})
    with pytest.raises(CheckpointError) as error:
        check_weights(tmp_path, missing.items())
    assert_one_line(error, "lacks tensor 'lm_head.weight'")
    with pytest.raises(CheckpointError) as error:
        check_shape("x.weight", torch.zeros(2, 3), (3, 2), file="model.safetensors")
    assert_one_line(error, "model.safetensors", "'x.weight'", "[2, 3]", "[3, 2]")
    check_shape("x.weight", torch.zeros(2, 3), (2, 3))


@pytest.mark.parametrize(
    "quantization",
    [
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        {"quant_method": "compressed-tensors", "format": "pack-quantized"},
    ],
    ids=lambda q: q["quant_method"],
)
def test_a_quantized_checkpoint_is_refused_by_its_method(tmp_path: Path, quantization) -> None:
    """A checkpoint whose config.json carries a `quantization_config` stores its weights
    in a format pdserve does not read (packed, with scales beside them): refused in one
    line naming the method, rather than loaded as if the numbers were plain weights."""
    folder = write_config(tmp_path / "ckpt", quantization_config=quantization)
    with pytest.raises(CheckpointError) as error:
        ModelConfig.from_folder(folder)
    assert_one_line(error, "config.json", "quantization_config", quantization["quant_method"])
    unnamed = write_config(tmp_path / "unnamed", quantization_config={"bits": 4})
    with pytest.raises(CheckpointError) as error:
        ModelConfig.from_folder(unnamed)
    assert_one_line(error, "quantization_config", "no quant_method")
