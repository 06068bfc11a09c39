"""Reading a Hugging Face checkpoint folder offline: its config and generation defaults
(the weights: `pdserve.engine.checkpoint_weights`).

Every problem with the folder surfaces as one `CheckpointError` whose message is a single line
naming the file and what is wrong, so the CLI and the gateway can show it as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from pdserve.common.json_file import read_json_file

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_FIELDS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
# Defaults that transformers' config classes apply when config.json omits a key.
_MAX_POSITIONS_DEFAULT = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 131072,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
}
GENERATION_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be served; the message is one line naming the file."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or {"rope_type": "llama3", ...its four fields}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on the q, k and v projections
    o_proj_bias: bool  # Llama's attention_bias also puts a bias on o_proj; Qwen2's does not
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: list[int]

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = require_folder(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: missing config.json")
        return cls.from_dict(read_json(path), path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: Path | str = "config.json") -> ModelConfig:
        reader = _ConfigReader(raw, path)
        architecture = reader.architecture()
        reader.refuse_quantization()
        hidden = reader.positive_int("hidden_size")
        heads = reader.positive_int("num_attention_heads")
        kv_heads = reader.positive_int("num_key_value_heads", default=heads)
        if heads % kv_heads:
            reader.fail(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                reader.fail(
                    f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
                )
            head_dim = hidden // heads
        head_dim = reader.positive_int("head_dim", default=head_dim)
        if reader.get("hidden_act", "silu") != "silu":
            reader.fail(f"hidden_act {raw['hidden_act']!r} is not supported (supported: silu)")
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        is_mistral = architecture == "MistralForCausalLM"
        attention_bias = bool(reader.get("attention_bias", False)) and not is_mistral
        return cls(
            architecture=architecture,
            vocab_size=reader.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=reader.positive_int("intermediate_size"),
            num_hidden_layers=reader.positive_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=reader.positive_float("rms_norm_eps", default=1e-6),
            rope_theta=reader.rope_theta(),
            rope_scaling=reader.rope_scaling(),
            max_position_embeddings=reader.positive_int(
                "max_position_embeddings", default=_MAX_POSITIONS_DEFAULT[architecture]
            ),
            tie_word_embeddings=bool(reader.get("tie_word_embeddings", False)),
            attention_bias=True if is_qwen2 else attention_bias,
            o_proj_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(reader.get("mlp_bias", False)) and architecture == "LlamaForCausalLM",
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=reader.sliding_window(architecture),
            torch_dtype=str(reader.get("torch_dtype") or reader.get("dtype") or "float32"),
            bos_token_id=reader.optional_int("bos_token_id"),
            eos_token_ids=reader.token_ids("eos_token_id"),
        )


class _ConfigReader:
    """Typed reads from one config.json, each failure naming the file and the key."""

    def __init__(self, raw: dict[str, Any], path: Path | str):
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        self.raw = raw
        self.path = path

    def fail(self, message: str) -> NoReturn:
        raise CheckpointError(f"{self.path}: {message}")

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def architecture(self) -> str:
        names = self.raw.get("architectures")
        if not isinstance(names, list) or not names or not isinstance(names[0], str):
            self.fail("missing 'architectures' (a list naming the model class)")
        if names[0] not in SUPPORTED_ARCHITECTURES:
            self.fail(
                f"unsupported architecture {names[0]!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return names[0]

    def refuse_quantization(self) -> None:
        """A checkpoint quantized by another tool stores packed weights and scales the
        model classes do not read: refused by its method, never loaded as plain weights."""
        config = self.raw.get("quantization_config")
        if config is None:
            return
        method = config.get("quant_method") if isinstance(config, dict) else None
        named = f"quant_method {method!r}" if isinstance(method, str) else "no quant_method"
        self.fail(
            f"quantization_config ({named}) is not served: pdserve reads 16/32-bit weights "
            "(--quantization int8 quantizes them at load)"
        )

    def positive_int(self, key: str, default: Any = None) -> int:
        value = self.get(key, default)
        if value is None:
            self.fail(f"missing {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.fail(f"{key!r} must be a positive integer, got {value!r}")
        return value

    def positive_float(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            self.fail(f"{key!r} must be a positive number, got {value!r}")
        return float(value)

    def optional_int(self, key: str) -> int | None:
        value = self.raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            self.fail(f"{key!r} must be an integer, got {value!r}")
        return value

    def token_ids(self, key: str) -> list[int]:
        try:
            return normalise_token_ids(self.raw.get(key))
        except ValueError as exc:
            self.fail(f"{key!r} {exc}")
        raise AssertionError("unreachable")

    def rope_parameters(self) -> dict[str, Any]:
        # transformers 5 writes rope_theta and the scaling into one `rope_parameters` dict.
        params = self.raw.get("rope_parameters") or {}
        if not isinstance(params, dict):
            self.fail(f"'rope_parameters' must be an object, got {params!r}")
        return params

    def rope_theta(self) -> float:
        value = self.raw.get("rope_theta")
        if value is None:
            value = self.rope_parameters().get("rope_theta", 10000.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            self.fail(f"'rope_theta' must be a positive number, got {value!r}")
        return float(value)

    def rope_scaling(self) -> dict[str, Any] | None:
        scaling = self.raw.get("rope_scaling")
        key = "rope_scaling"
        if scaling is None:
            scaling, key = self.rope_parameters(), "rope_parameters"
        if not isinstance(scaling, dict):
            self.fail(f"{key!r} must be an object or null, got {scaling!r}")
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            return None
        if kind != "llama3":
            self.fail(f"unsupported {key} type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        missing = [name for name in LLAMA3_ROPE_FIELDS if scaling.get(name) is None]
        if missing:
            self.fail(f"{key} of type 'llama3' lacks {', '.join(missing)}")
        result: dict[str, Any] = {"rope_type": "llama3"}
        for name in LLAMA3_ROPE_FIELDS:
            value = scaling[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                self.fail(f"{key} field {name!r} must be a positive number, got {value!r}")
            result[name] = value
        if result["high_freq_factor"] <= result["low_freq_factor"]:
            self.fail(f"{key} needs high_freq_factor > low_freq_factor")
        result["original_max_position_embeddings"] = int(result["original_max_position_embeddings"])
        return result

    def sliding_window(self, architecture: str) -> int | None:
        window = self.raw.get("sliding_window")
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            if not self.raw.get("use_sliding_window", False):
                return None
            # Qwen applies the window only from `max_window_layers` on; a per-layer window is
            # not something the model classes model, so refuse rather than run it wrong.
            self.fail("use_sliding_window=true is not supported for Qwen models")
        elif architecture != "MistralForCausalLM":
            return None
        if window is None:
            return None
        return self.positive_int("sliding_window")


def normalise_token_ids(value: Any) -> list[int]:
    """An eos entry (absent, one id, or a list of ids) as a list of ids."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"must be a token id or a list of token ids, got {value!r}")
    return list(values)


@dataclass(frozen=True)
class GenerationConfig:
    """generation_config.json: eos ids and the sampling defaults that requests override."""

    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    defaults: dict[str, Any] = field(default_factory=dict)  # only the keys the file sets

    @classmethod
    def from_folder(cls, folder: str | Path) -> GenerationConfig:
        path = require_folder(folder) / "generation_config.json"
        if not path.is_file():
            return cls()
        raw = read_json(path)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        try:
            eos = normalise_token_ids(raw.get("eos_token_id"))
        except ValueError as exc:
            raise CheckpointError(f"{path}: 'eos_token_id' {exc}") from None
        bos = raw.get("bos_token_id")
        if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
            raise CheckpointError(f"{path}: 'bos_token_id' must be an integer, got {bos!r}")
        defaults = {}
        for key in GENERATION_DEFAULT_KEYS:
            value = raw.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise CheckpointError(f"{path}: {key!r} must be a number, got {value!r}")
            defaults[key] = value
        # transformers samples greedily when do_sample is false, whatever the temperature says.
        if raw.get("do_sample") is False and "temperature" in defaults:
            defaults["temperature"] = 0.0
        return cls(eos_token_ids=eos, bos_token_id=bos, defaults=defaults)


def load_model_config(folder: str | Path) -> ModelConfig:
    return ModelConfig.from_folder(folder)


def load_generation_config(folder: str | Path) -> GenerationConfig:
    return GenerationConfig.from_folder(folder)


def require_folder(folder: str | Path) -> Path:
    path = Path(folder).expanduser()
    if not path.is_dir():
        what = "not a folder" if path.exists() else "no such checkpoint folder"
        raise CheckpointError(f"{path}: {what}")
    return path


def read_json(path: Path) -> Any:
    return read_json_file(path, CheckpointError)
