"""Decode steps on CPU run as one C call: the model's forward and LM head recorded once
per batch size as a program of kernel calls (`kernels/cpu_program.py`), then replayed.

A batch-1 decode step of a small model makes ~250 kernel calls; through Python each
costs a few microseconds of argument checks, tensor allocation and ctypes packing, a
third of the step. Pure-decode batches of up to `max_size` sequences (every sequence
one new token) instead run a program recorded for exactly their size, over static
buffers: the inputs staged as for the CUDA graphs (`cuda_graphs.DecodeInputBuffers`),
every activation a buffer of its own, the logits in one. Recording goes through the
ops' own bindings, so a replay makes the calls the eager forward makes, with the same
numbers; the tests compare the two bit for bit. Other batches, and models whose
forward has a step a program cannot hold (tensor parallelism, pipeline stages, q/k
norms, a matrix in several GGUF segments or with a GGUF bias, an op that would run as a
torch reference), run eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from pdserve.engine.cuda_graphs import DecodeInputBuffers
from pdserve.engine.models.packed import PLAIN, PackedMatrix
from pdserve.kernels import AttentionMetadata, dispatch, kv_scale_args
from pdserve.kernels.cpu_layer_ops import CpuLayerOps
from pdserve.kernels.cpu_program import CpuProgram
from pdserve.kernels.cpu_quantized import CpuQuantizedLinear

if TYPE_CHECKING:
    from pdserve.engine.models.llama import DecoderLayer, LlamaForCausalLM

Tensor = torch.Tensor
log = logging.getLogger(__name__)
DEFAULT_MAX_SIZE = 8  # batch sizes recorded: each holds its own activation buffers


class NotRecordable(Exception):
    """The model's decode step has a part a program of C calls cannot hold."""


def unrecordable_reason(model: LlamaForCausalLM) -> str | None:
    """Why this model's decode steps cannot run as programs, or None."""
    if model.tp.enabled:
        return "tensor parallelism (its all-reduces run between kernels)"
    if model.embed is None or model.norm is None:
        return "a pipeline stage"
    if model.hidden_dtype != torch.float32:
        return f"{model.hidden_dtype} activations"
    if model.layers[0].attn.q_norm is not None:  # type: ignore[union-attr]
        return "q/k norms"
    return None


@dataclass
class _Step:
    """One batch size's program, the buffers it reads its inputs from, its logits."""

    program: CpuProgram
    hidden: Tensor  # the embedded tokens [n, hidden]
    logits: Tensor  # [n, vocab] float32
    buffers: list[Tensor]  # every tensor the program's calls point at


class _Recorder:
    """Records one batch size's forward: the model's decode step, op by op, through the
    kernels' recording view. Every output an op returns is kept: the program writes it."""

    def __init__(self, kernels: Any, model: LlamaForCausalLM, kv_caches: list[Tensor]):
        self.program = CpuProgram(kernels)
        self.view = self.program.recorder()
        self.layer_ops = CpuLayerOps(self.view)
        self.quantized = CpuQuantizedLinear(self.view)
        self.model = model
        self.kv_caches = kv_caches
        self.kept: list[Tensor] = []

    def record(self, inputs: DecodeInputBuffers, size: int) -> _Step:
        model = self.model
        _, positions, meta = inputs.views(size)
        hidden = torch.zeros(size, model.cfg.hidden_size, dtype=torch.float32)
        self.kept += [hidden, positions, meta.slot_mapping, meta.block_tables, meta.context_lens]
        layers = cast("list[DecoderLayer]", list(model.layers))
        out = self._op(layers[0].input_norm, hidden)
        residual = hidden
        for i, (layer, kv_cache) in enumerate(zip(layers, self.kv_caches, strict=True)):
            if i:
                out, residual = self._op(layer.input_norm, out, residual)
            out = self._attention(layer, positions, out, kv_cache, meta)
            out, residual = self._op(layer.post_attn_norm, out, residual)
            mlp = layer.mlp
            gate_up = self._project(out, mlp.gate_up_weight, mlp.gate_up_bias, mlp.gate_up_scales)
            act = self._one(self.layer_ops.silu_and_mul, gate_up)
            out = self._project(act, mlp.down_weight, mlp.down_bias, mlp.down_scales)
        assert model.norm is not None and model.embed is not None  # unrecordable_reason
        out, _ = self._op(model.norm, out, residual)
        head = model.embed if model.lm_head is None else model.lm_head
        logits = self._project(out, head, None, None)
        self.program.seal()
        return _Step(self.program, hidden, logits, self.kept)

    def _attention(
        self,
        layer: DecoderLayer,
        positions: Tensor,
        x: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
    ) -> Tensor:
        attn = layer.attn
        n = x.shape[0]
        qkv = self._project(x, attn.qkv_weight, attn.qkv_bias, attn.qkv_scales)
        kv = attn.kv_scales
        scales = kv_scale_args(kv_cache, kv.get("k_scale", 1.0), kv.get("v_scale", 1.0))
        q = self._one(
            self.layer_ops.rotary_write_kv_cache,
            positions,
            qkv,
            self.model.cos_sin,
            kv_cache,
            meta.slot_mapping,
            attn.num_heads,
            **kv,
        )
        context = self._one(
            self.view.decode_attention,
            q,
            kv_cache,
            meta.block_tables,
            meta.context_lens,
            attn.scale,
            meta.sliding_window,
            None,
            **scales,
        )
        context = context.reshape(n, attn.q_size)
        return self._project(context, attn.o_weight, attn.o_bias, attn.o_scales)

    def _op(self, norm: Any, x: Tensor, residual: Tensor | None = None) -> Any:
        """A norm of the model (RMSNorm), with the residual add where given."""
        return self._one(self.layer_ops.rms_norm, x, norm.weight, norm.eps, residual)

    def _project(
        self, x: Tensor, weight: Tensor | PackedMatrix, bias: Tensor | None, scales: Tensor | None
    ) -> Tensor:
        """`packed.project`'s dispatch, each kind of matrix by its own binding."""
        if isinstance(weight, PackedMatrix):
            segments = weight.segments()
            if len(segments) != 1 or bias is not None:
                raise NotRecordable("a GGUF matrix in several segments or with a bias")
            w, qtype = segments[0]
            if qtype == PLAIN:
                return self._one(self.view.linear, x, w)
            return self._one(self.quantized.linear_gguf, x, w, qtype, None, weight.weight_dtype)
        if scales is None:
            return self._one(self.view.linear, x, weight, bias)
        return self._one(self.quantized.linear_int8, x, weight, scales, bias)

    def _one(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        """Calls a binding that must record exactly one call (one that fell back to its
        torch reference records none) and keeps what it returned."""
        before = len(self.program)
        result = op(*args, **kwargs)
        if len(self.program) != before + 1:
            raise NotRecordable("an op of the step runs as a torch reference")
        self.kept += list(result) if isinstance(result, tuple) else [result]
        return result


class CpuDecodeSteps:
    """Pure-decode steps of 1 to `max_size` sequences, each size's recorded on its first
    step and replayed after; None from `for_model` where the model cannot be recorded."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[Tensor],
        max_size: int,
        max_blocks_per_seq: int,
        block_size: int,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.max_size = max_size
        self.inputs = DecodeInputBuffers(
            max_size, max_blocks_per_seq, block_size, torch.device("cpu"), model.sliding_window
        )
        self._steps: dict[int, _Step] = {}
        self._recorded_for: tuple[Any, ...] = ()
        self.disabled_reason: str | None = None

    @classmethod
    def for_model(
        cls,
        model: LlamaForCausalLM,
        kv_caches: list[Tensor],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
    ) -> CpuDecodeSteps | None:
        reason = unrecordable_reason(model)
        if reason is None and dispatch.cpu_kernels() is None:
            reason = "the C kernels are off"
        if reason is not None:
            log.info("CPU decode steps run eagerly: %s", reason)
            return None
        size = min(max_num_seqs, DEFAULT_MAX_SIZE)
        return cls(model, kv_caches, size, -(-max_model_len // block_size), block_size)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Pure decode within the recorded sizes and table width, on the C kernels."""
        n = meta.num_seqs
        return (
            self.disabled_reason is None
            and 0 < n <= self.max_size
            and meta.num_decode_seqs == n
            and meta.slot_mapping.shape[0] == n
            and meta.block_tables.shape[1] <= self.inputs.width
            and dispatch.cpu_kernels() is not None
        )

    def run(
        self, token_ids: Tensor, positions: Tensor, meta: AttentionMetadata, indices: Tensor
    ) -> Tensor | None:
        """Logits [len(indices), vocab] float32 (a fresh tensor); None where the step
        cannot be recorded (it is then never tried again: the caller runs it eagerly)."""
        n = meta.num_seqs
        step = self._step(n)
        if step is None:
            return None
        staged = self.inputs.stage(token_ids, positions, meta, indices, n)
        model = self.model
        assert model.embed is not None  # recorded: the whole model
        table = self.inputs.buffers["token_ids"][:n]
        step.hidden.copy_(model.tp.embed(table, model.embed, model.cfg.vocab_size, torch.float32))
        step.program.run()
        return step.logits.index_select(0, staged)

    def _step(self, size: int) -> _Step | None:
        kernels = dispatch.cpu_kernels()
        # A program holds the thread count and the bf16 switch its calls were packed with.
        key = (kernels, kernels.bf16_dot, torch.get_num_threads())
        if key != self._recorded_for:
            self._steps.clear()
            self._recorded_for = key
        step = self._steps.get(size)
        if step is None:
            try:
                step = _Recorder(kernels, self.model, self.kv_caches).record(self.inputs, size)
            except NotRecordable as exc:
                self.disabled_reason = str(exc)
                log.info("CPU decode steps run eagerly: %s", exc)
                return None
            self._steps[size] = step
        return step
