"""The Llama family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

Tokens arrive as one flat batch [num_tokens] (no padding); attention goes through the
paged KV cache via `kernels.paged_attention`. Q/K/V and gate/up projections are fused
into single matmuls because on CPU every op costs fixed overhead per layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn

from pdserve.engine.models.int8 import Int8Linears
from pdserve.engine.models.lanes import LanesMatrix
from pdserve.engine.models.packed import PackedMatrix, project
from pdserve.engine.models.rope import cos_sin_cache
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.pipeline import PipelineStage
from pdserve.kernels import (
    AttentionMetadata,
    attend_cached,
    paged_attention,
    rms_norm,
    rotary_embedding,
    rotary_write_kv_cache,
    silu_and_mul,
)

# An FP8 KV cache's per-layer scales (vLLM's names), read by engine/kv_scales.py.
KV_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")

Tensor = torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """This rank's heads (all of them at TP=1) and their KV heads; the output projection
    is row-parallel: partial sums, one all-reduce, then the bias."""

    def __init__(self, cfg, layer_index: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        out = self.q_size + 2 * self.kv_size
        self.qkv_weight = nn.Parameter(torch.empty(out, cfg.hidden_size), requires_grad=False)
        self.qkv_bias = (
            nn.Parameter(torch.empty(out), requires_grad=False) if cfg.attention_bias else None
        )
        self.o_weight = nn.Parameter(torch.empty(cfg.hidden_size, self.q_size), requires_grad=False)
        self.o_bias = (
            nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
            if cfg.o_proj_bias
            else None
        )
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.layer_index = layer_index
        self.qkv_scales = self.o_scales = None  # per-group scales of int8 weights (int8.py)
        self.kv_scales: dict[str, float] = {}  # an FP8 cache's k/v scales (kv_scales.py)

    def forward(
        self,
        positions: Tensor,
        hidden: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        cos_sin: Tensor,
    ) -> Tensor:
        n = hidden.shape[0]
        qkv = project(hidden, self.qkv_weight, self.qkv_bias, self.qkv_scales)
        kv_scales = self.kv_scales
        if self.q_norm is None:  # rotary and the KV write in one op, straight from qkv
            q = rotary_write_kv_cache(
                positions, qkv, cos_sin, kv_cache, meta.slot_mapping, self.num_heads, **kv_scales
            )
            attn = attend_cached(q, kv_cache, meta, self.scale, **kv_scales)
        else:
            attn = self._attend_normed(positions, qkv, kv_cache, meta, cos_sin)
        attn = attn.reshape(n, self.q_size)
        if not self.tp.enabled:
            return project(attn, self.o_weight, self.o_bias, self.o_scales)
        out = self.tp.all_reduce(project(attn, self.o_weight, None, self.o_scales))
        return out if self.o_bias is None else out + self.o_bias

    def _attend_normed(
        self, positions: Tensor, qkv: Tensor, kv_cache: Tensor, meta: AttentionMetadata, cos_sin
    ) -> Tensor:
        """Attention with q/k norms (Qwen3): normed before the rotation."""
        assert self.q_norm is not None and self.k_norm is not None  # forward checked q_norm
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = rotary_embedding(positions, self.q_norm(q), self.k_norm(k), cos_sin)
        return paged_attention(q, k, v, kv_cache, meta, self.scale, **self.kv_scales)


class MLP(nn.Module):
    """Gate/up column-parallel, down row-parallel (one all-reduce, then the bias)."""

    def __init__(self, cfg, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.intermediate = cfg.intermediate_size // tp.size
        self.gate_up_weight = nn.Parameter(
            torch.empty(2 * self.intermediate, cfg.hidden_size), requires_grad=False
        )
        self.down_weight = nn.Parameter(
            torch.empty(cfg.hidden_size, self.intermediate), requires_grad=False
        )
        self.gate_up_bias = self.down_bias = None
        if cfg.mlp_bias:
            self.gate_up_bias = nn.Parameter(
                torch.empty(2 * self.intermediate), requires_grad=False
            )
            self.down_bias = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        self.gate_up_scales = self.down_scales = None  # per-group scales of int8 weights

    def forward(self, x: Tensor) -> Tensor:
        gate_up = project(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_scales)
        hidden = silu_and_mul(gate_up)
        if not self.tp.enabled:
            return project(hidden, self.down_weight, self.down_bias, self.down_scales)
        out = self.tp.all_reduce(project(hidden, self.down_weight, None, self.down_scales))
        return out if self.down_bias is None else out + self.down_bias


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_index: int, tp: TensorParallel):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_index, tp)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin):
        if residual is None:
            residual = hidden
            hidden = self.input_norm(hidden)
        else:
            hidden, residual = self.input_norm(hidden, residual)
        hidden = self.attn(positions, hidden, kv_cache, meta, cos_sin)
        hidden, residual = self.post_attn_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral, Qwen2 and Qwen3: they differ only in config flags. With
    `tp`, the rank's slice of it (`engine/parallel.py`); with `stage`, only the stage's
    layers, the embedding on the first stage, the final norm and LM head on the last
    (`engine/pipeline.py`)."""

    def __init__(self, cfg, tp: TensorParallel | None = None, stage: PipelineStage | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TensorParallel()
        self.stage = stage = stage or PipelineStage.of(cfg.num_hidden_layers)
        vocab_rows = tp.vocab_rows(cfg.vocab_size)[2]
        tied_head = stage.is_last and cfg.tie_word_embeddings
        # Tables are parameters, or GGUF blocks (`PackedMatrix`) where a file keeps them so.
        self.embed: Tensor | PackedMatrix | LanesMatrix | None = (
            nn.Parameter(torch.zeros(vocab_rows, cfg.hidden_size), requires_grad=False)
            if stage.is_first or tied_head
            else None
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, tp) for i in range(stage.layer_start, stage.layer_end)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.is_last else None
        self.lm_head: Tensor | PackedMatrix | LanesMatrix | None = (
            nn.Parameter(torch.zeros(vocab_rows, cfg.hidden_size), requires_grad=False)
            if stage.is_last and not cfg.tie_word_embeddings
            else None
        )
        self.register_buffer(
            "cos_sin",
            cos_sin_cache(
                cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
            ),
            persistent=False,
        )
        self.int8: Int8Linears | None = None  # set by `quantize_int8`

    def quantize_int8(self) -> Int8Linears:
        """Every decoder layer's matrices become int8 with per-group scales, before the
        checkpoint is read (`engine/models/int8.py`)."""
        self.int8 = Int8Linears(self.layers)
        return self.int8

    @property
    def hidden_dtype(self) -> torch.dtype:
        """The compute dtype, between layers and stages (the table may be narrower)."""
        return cast(DecoderLayer, self.layers[0]).input_norm.weight.dtype

    @property
    def sliding_window(self) -> int | None:
        return self.cfg.sliding_window

    def forward(
        self,
        token_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
        carried: Tensor | None = None,
    ) -> Tensor:
        """Hidden states after the final norm: [num_tokens, hidden]. A later pipeline
        stage starts from `carried` instead of the tokens, and a stage before the last
        returns [2, num_tokens, hidden]: hidden states and residual for the next one."""
        if carried is None:
            assert self.embed is not None  # the first stage: it holds the table
            # The table may be stored narrower than the compute dtype (precision.py).
            hidden = self.tp.embed(token_ids, self.embed, self.cfg.vocab_size, self.hidden_dtype)
            residual = None
        else:
            hidden, residual = carried[0], carried[1]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, self.cos_sin)
        if self.norm is None:
            assert residual is not None  # every stage holds at least one layer
            return torch.stack((hidden, residual))
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: Tensor) -> Tensor:
        head = self.embed if self.lm_head is None else self.lm_head
        assert head is not None  # the last stage: it holds the head (or the tied table)
        logits = project(hidden, head, None, None).float()
        if not self.tp.enabled:
            return logits
        return self.tp.gather_columns(logits)[:, : self.cfg.vocab_size]

    # ---- weights -------------------------------------------------------------------

    def expected_weights(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every Hugging Face tensor name this model needs, with its shape."""
        cfg = self.cfg
        h, d = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        if self.embed is not None:
            yield "model.embed_tokens.weight", (cfg.vocab_size, h)
        if self.norm is not None:
            yield "model.norm.weight", (h,)
        if self.lm_head is not None:
            yield "lm_head.weight", (cfg.vocab_size, h)
        for i in range(self.stage.layer_start, self.stage.layer_end):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (h,)
            yield p + "post_attention_layernorm.weight", (h,)
            for name, rows in (("q", q), ("k", kv), ("v", kv)):
                yield p + f"self_attn.{name}_proj.weight", (rows, h)
                if cfg.attention_bias:
                    yield p + f"self_attn.{name}_proj.bias", (rows,)
            yield p + "self_attn.o_proj.weight", (h, q)
            if cfg.o_proj_bias:
                yield p + "self_attn.o_proj.bias", (h,)
            if cfg.qk_norm:
                yield p + "self_attn.q_norm.weight", (d,)
                yield p + "self_attn.k_norm.weight", (d,)
            yield p + "mlp.gate_proj.weight", (cfg.intermediate_size, h)
            yield p + "mlp.up_proj.weight", (cfg.intermediate_size, h)
            yield p + "mlp.down_proj.weight", (h, cfg.intermediate_size)
            if cfg.mlp_bias:
                yield p + "mlp.gate_proj.bias", (cfg.intermediate_size,)
                yield p + "mlp.up_proj.bias", (cfg.intermediate_size,)
                yield p + "mlp.down_proj.bias", (h,)

    def holds(self, name: str) -> bool:
        """Whether this stage reads the tensor at all (other stages' layers, the embedding,
        norm and head where they do not live, and FP8 KV scales stay unread here)."""
        if name.startswith("model.layers."):
            return self.stage.holds_layer(int(name.split(".")[2])) and not KV_SCALE_NAME.match(name)
        if name == "model.embed_tokens.weight":
            return self.embed is not None
        if name == "model.norm.weight":
            return self.norm is not None
        if name == "lm_head.weight":
            return self.lm_head is not None
        return True  # anything else: load_weights decides (ignored or refused)

    def shard_of(self, name: str) -> tuple[int, int, int] | None:
        """The part of a Hugging Face tensor this rank holds: (dim, start, stop), or None
        for all of it. Loading reads only that part from the file."""
        tp, cfg = self.tp, self.cfg
        if not tp.enabled:
            return None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, stop, _ = tp.vocab_rows(cfg.vocab_size)
            return 0, start, stop
        key = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        d = cfg.head_dim
        rows = {
            "self_attn.q_proj": cfg.num_attention_heads * d,
            "self_attn.k_proj": cfg.num_key_value_heads * d,
            "self_attn.v_proj": cfg.num_key_value_heads * d,
            "mlp.gate_proj": cfg.intermediate_size,
            "mlp.up_proj": cfg.intermediate_size,
        }
        module, _, kind = key.rpartition(".")
        if module in rows:  # column-parallel: this rank's output rows (weight and bias)
            return (0, *tp.split(rows[module]))
        if key == "self_attn.o_proj.weight":  # row-parallel: this rank's input columns
            return (1, *tp.split(cfg.num_attention_heads * d))
        if key == "mlp.down_proj.weight":
            return (1, *tp.split(cfg.intermediate_size))
        return None  # norms, and the row-parallel biases (added once, after the reduce)

    def target_of(self, name: str) -> tuple[Tensor, int]:
        """The parameter slice a Hugging Face tensor is copied into: (param, row offset)."""
        # Only names of expected_weights() come here: the stage holds what they name.
        # (A table held as GGUF blocks is never a target: the GGUF loader sets it whole.)
        if name == "model.embed_tokens.weight" and isinstance(self.embed, Tensor):
            return self.embed, 0
        if name == "model.norm.weight" and self.norm is not None:
            return self.norm.weight, 0
        if name == "lm_head.weight" and isinstance(self.lm_head, Tensor):
            return self.lm_head, 0
        parts = name.split(".")
        layer = cast(DecoderLayer, self.layers[int(parts[2]) - self.stage.layer_start])
        key = ".".join(parts[3:])
        attn = layer.attn
        qkv_offsets = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size}
        table = {
            "input_layernorm.weight": (layer.input_norm.weight, 0),
            "post_attention_layernorm.weight": (layer.post_attn_norm.weight, 0),
            "self_attn.o_proj.weight": (attn.o_weight, 0),
            "mlp.gate_proj.weight": (layer.mlp.gate_up_weight, 0),
            "mlp.up_proj.weight": (layer.mlp.gate_up_weight, layer.mlp.intermediate),
            "mlp.down_proj.weight": (layer.mlp.down_weight, 0),
        }
        for proj, offset in qkv_offsets.items():
            table[f"self_attn.{proj}_proj.weight"] = (attn.qkv_weight, offset)
            if attn.qkv_bias is not None:
                table[f"self_attn.{proj}_proj.bias"] = (attn.qkv_bias, offset)
        if attn.o_bias is not None:
            table["self_attn.o_proj.bias"] = (attn.o_bias, 0)
        if layer.mlp.gate_up_bias is not None and layer.mlp.down_bias is not None:
            table["mlp.gate_proj.bias"] = (layer.mlp.gate_up_bias, 0)
            table["mlp.up_proj.bias"] = (layer.mlp.gate_up_bias, layer.mlp.intermediate)
            table["mlp.down_proj.bias"] = (layer.mlp.down_bias, 0)
        if attn.q_norm is not None and attn.k_norm is not None:
            table["self_attn.q_norm.weight"] = (attn.q_norm.weight, 0)
            table["self_attn.k_norm.weight"] = (attn.k_norm.weight, 0)
        return table[key]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy Hugging Face tensors into the fused parameters, checking every shape."""
        expected = {name: self._local_shape(name, shape) for name, shape in self.expected_weights()}
        seen: set[str] = set()
        for name, tensor in weights:
            if name not in expected:
                if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                    continue  # some tied checkpoints still store the head
                if "rotary_emb" in name:
                    continue
                raise WeightError(f"unexpected tensor {name!r} for {self.cfg.architecture}")
            if tuple(tensor.shape) != expected[name]:
                raise WeightError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}"
                )
            param, offset = self.target_of(name)
            if self.int8 is not None and self.int8.holds(param):
                self.int8.store(tensor, param, offset)
            else:
                param.data[offset : offset + tensor.shape[0]].copy_(tensor)
            seen.add(name)
        missing = [n for n in expected if n not in seen]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise WeightError(f"checkpoint lacks tensor {missing[0]!r}{more}")

    def _local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        shard = self.shard_of(name)
        if shard is None:
            return shape
        dim, start, stop = shard
        return tuple(stop - start if i == dim else size for i, size in enumerate(shape))


class WeightError(ValueError):
    pass
