"""Decode steps on CPU run as one C call: the model's forward and LM head recorded once
per batch size as a program of kernel calls (`kernels/cpu_program.py`), then replayed.

A decode step of a small model makes ~250 kernel calls; through Python each costs a few
microseconds of argument checks, tensor allocation and ctypes packing: 4-5 ms a step,
a third of a batch-1 step, a tenth at 32 sequences. Pure-decode batches of up to
`max_size` sequences (every sequence one new token) instead run a program recorded for
exactly their size, over static buffers: the inputs staged as for the CUDA graphs
(`cuda_graphs.DecodeInputBuffers`), the activations in buffers every layer and every
size shares (`Activations`). Recording goes through the ops' own bindings, so a replay
makes the calls the eager forward makes, with the same numbers; the tests compare the
two bit for bit. Other batches, and models whose forward has a step a program cannot
hold (tensor parallelism, pipeline stages, q/k norms, a matrix in several GGUF segments
or with a GGUF bias, an op that would run as a torch reference), run eagerly.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from pdserve.engine.cuda_graphs import DecodeInputBuffers
from pdserve.engine.models.lanes import LanesMatrix
from pdserve.engine.models.packed import PLAIN, PackedMatrix
from pdserve.kernels import AttentionMetadata, dispatch, kv_scale_args
from pdserve.kernels.cpu_layer_ops import CpuLayerOps
from pdserve.kernels.cpu_program import CpuProgram
from pdserve.kernels.cpu_quantized import CpuQuantizedLinear
from pdserve.kernels.op_args import RotaryWriteKV

if TYPE_CHECKING:
    from pdserve.engine.models.llama import DecoderLayer, LlamaForCausalLM

Tensor = torch.Tensor
log = logging.getLogger(__name__)
DEFAULT_MAX_SIZE = 64  # above it the Python between kernels is a small share of a step


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
    """One batch size's program, the rows it reads its inputs from, its logits."""

    program: CpuProgram
    hidden: Tensor  # the embedded tokens [n, hidden]
    logits: Tensor  # [n, vocab] float32


class Activations:
    """The buffers every recorded program writes its activations to, `max_size` rows
    each: a program of n sequences uses their first n rows, every layer the same ones, so
    the memory does not grow with the layers or with the number of sizes recorded."""

    def __init__(self, model: LlamaForCausalLM, max_size: int):
        cfg = model.cfg
        attn = cast("DecoderLayer", model.layers[0]).attn
        mlp = cast("DecoderLayer", model.layers[0]).mlp
        hidden = cfg.hidden_size
        widths = {
            "hidden": hidden,
            "normed": hidden,
            "residual": hidden,
            "qkv": attn.q_size + 2 * attn.kv_size,
            "attn_out": hidden,
            "gate_up": 2 * mlp.intermediate,
            "act": mlp.intermediate,
            "down": hidden,
            "logits": cfg.vocab_size,
        }
        self.rows = {name: torch.zeros(max_size, w) for name, w in widths.items()}
        heads = (max_size, attn.num_heads, attn.head_dim)
        self.rows["query"] = torch.zeros(heads)
        self.rows["context"] = torch.zeros(heads)

    def take(self, name: str, size: int) -> Tensor:
        return self.rows[name][:size]


class _Recorder:
    """Records one batch size's forward: the model's decode step, op by op, through the
    kernels' recording view, every output into its rows of the shared activations."""

    def __init__(
        self,
        kernels: Any,
        model: LlamaForCausalLM,
        kv_caches: list[Tensor],
        activations: Activations,
        size: int,
    ):
        self.program = CpuProgram(kernels)
        self.view = self.program.recorder()
        self.layer_ops = CpuLayerOps(self.view)
        self.quantized = CpuQuantizedLinear(self.view)
        self.model = model
        self.kv_caches = kv_caches
        self.size = size
        self.rows = functools.partial(activations.take, size=size)

    def record(self, inputs: DecodeInputBuffers) -> _Step:
        model, rows = self.model, self.rows
        _, positions, meta = inputs.views(self.size)
        hidden, normed, residual = rows("hidden"), rows("normed"), rows("residual")
        layers = cast("list[DecoderLayer]", list(model.layers))
        self._norm(layers[0].input_norm, hidden, None)
        first = hidden  # the first layer's residual is its input
        for i, (layer, kv_cache) in enumerate(zip(layers, self.kv_caches, strict=True)):
            if i:
                self._norm(layer.input_norm, rows("down"), residual)
            self._attention(layer, positions, normed, kv_cache, meta)
            self._norm(layer.post_attn_norm, rows("attn_out"), first if i == 0 else residual)
            mlp = layer.mlp
            self._project(
                normed, mlp.gate_up_weight, mlp.gate_up_bias, mlp.gate_up_scales, "gate_up"
            )
            self._one(self.layer_ops.silu_and_mul, rows("gate_up"), out=rows("act"))
            self._project(rows("act"), mlp.down_weight, mlp.down_bias, mlp.down_scales, "down")
        assert model.norm is not None and model.embed is not None  # unrecordable_reason
        self._norm(model.norm, rows("down"), residual)
        head = model.embed if model.lm_head is None else model.lm_head
        logits = self._project(normed, head, None, None, "logits")
        self.program.seal()
        return _Step(self.program, hidden, logits)

    def _attention(
        self,
        layer: DecoderLayer,
        positions: Tensor,
        x: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
    ) -> None:
        attn, rows = layer.attn, self.rows
        self._project(x, attn.qkv_weight, attn.qkv_bias, attn.qkv_scales, "qkv")
        kv = attn.kv_scales
        scales = kv_scale_args(kv_cache, kv.get("k_scale", 1.0), kv.get("v_scale", 1.0))
        op = RotaryWriteKV(
            positions,
            rows("qkv"),
            cast(Tensor, self.model.cos_sin),
            kv_cache,
            meta.slot_mapping,
            attn.num_heads,
            **kv,
        )
        self._one(self.layer_ops.rotary_into, op, rows("query"))
        self._one(
            self.view.decode_attention,
            rows("query"),
            kv_cache,
            meta.block_tables,
            meta.context_lens,
            attn.scale,
            meta.sliding_window,
            rows("context"),
            **scales,
        )
        context = rows("context").view(self.size, attn.q_size)
        self._project(context, attn.o_weight, attn.o_bias, attn.o_scales, "attn_out")

    def _norm(self, norm: Any, x: Tensor, residual: Tensor | None) -> None:
        """A norm of the model (RMSNorm) into the normed rows, with the residual added
        first where given (its sum into the residual rows: in place from the second)."""
        summed = None if residual is None else self.rows("residual")
        self._one(
            self.layer_ops.rms_norm, x, norm.weight, norm.eps, residual, self.rows("normed"), summed
        )

    def _project(
        self,
        x: Tensor,
        weight: Tensor | PackedMatrix | LanesMatrix,
        bias: Tensor | None,
        scales: Tensor | None,
        into: str,
    ) -> Tensor:
        """`packed.project`'s dispatch, each kind of matrix by its own binding, into the
        rows named `into`."""
        out = self.rows(into)
        if isinstance(weight, LanesMatrix):
            if not self.view.bf16_dot:  # its float32 path would unpack a temporary per call
                raise NotRecordable("packed bf16 matrices with bf16 dot products off")
            return self._one(self.view.linear_lanes, x, weight.packed, weight.n, bias, out)
        if isinstance(weight, PackedMatrix):
            segments = weight.segments()
            if len(segments) != 1 or bias is not None:
                raise NotRecordable("a GGUF matrix in several segments or with a bias")
            w, qtype = segments[0]
            if qtype == PLAIN:
                return self._one(self.view.linear, x, w, None, out)
            return self._one(
                self.quantized.linear_gguf, x, w, qtype, None, weight.weight_dtype, out
            )
        if scales is None:
            return self._one(self.view.linear, x, weight, bias, out)
        return self._one(self.quantized.linear_int8, x, weight, scales, bias, out)

    def _one(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        """Calls a binding that must record exactly one call (one that fell back to its
        torch reference records none)."""
        before = len(self.program)
        result = op(*args, **kwargs)
        if len(self.program) != before + 1:
            raise NotRecordable("an op of the step runs as a torch reference")
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
        self._activations: Activations | None = None  # made with the first program
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
            if self._activations is None:
                self._activations = Activations(self.model, self.max_size)
            recorder = _Recorder(kernels, self.model, self.kv_caches, self._activations, size)
            try:
                step = recorder.record(self.inputs)
            except NotRecordable as exc:
                self.disabled_reason = str(exc)
                log.info("CPU decode steps run eagerly: %s", exc)
                return None
            self._steps[size] = step
        return step
