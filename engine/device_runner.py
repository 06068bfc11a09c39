"""Runs the model's steps on a CUDA device.

The runner prepares every step on the host (numpy) as it does on CPU and hands it
here: pure-decode batches replay a captured CUDA graph (`pdserve.engine.cuda_graphs`); any
other batch (prefill chunks, more sequences than the largest graph) runs eagerly on
inputs staged through pinned memory. Logits come back on the device for the sampler. A
pipeline stage runs its micro-batches itself (`pdserve.engine.pipeline`), on inputs
staged by the same `stage`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import torch

from pdserve.engine.cuda_graphs import DecodeGraphs, capture_sizes, graph_blockers
from pdserve.engine.device_inputs import HostToDeviceStager
from pdserve.engine.kv_cache import KVCache
from pdserve.kernels import AttentionMetadata, load_triton_kernels

if TYPE_CHECKING:  # the GPU check runs this module where msgspec is not installed
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.models.llama import LlamaForCausalLM

Tensor = torch.Tensor
log = logging.getLogger(__name__)


class Step(Protocol):
    """A prepared step: `runner.StepBatch` and `step_inputs.StepInputs` both fit."""

    token_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    logits_indices: Tensor
    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass (dataclasses.replace)


S = TypeVar("S", bound=Step)  # a dataclass: staging copies it with device tensors


class DeviceRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        max_model_len: int,
        graph_sizes: list[int],
        capture: bool = True,
    ):
        """`graph_sizes` empty: every step eager. `capture=False` runs the decode steps
        of those sizes without capturing (the CPU tests' way through the same code)."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.storage.device
        self.stager = HostToDeviceStager(self.device)
        self.graphs: DecodeGraphs | None = None
        if graph_sizes:
            block_size = kv_cache.shape.block_size
            self.graphs = DecodeGraphs(
                model,
                kv_cache.layers,
                graph_sizes,
                max_blocks_per_seq=-(-max_model_len // block_size),
                block_size=block_size,
                vocab_size=model.cfg.vocab_size,
                device=self.device,
                capture=capture,
            )

    @classmethod
    def for_engine(
        cls,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        config: EngineConfig,
        max_model_len: int,
        graphs: bool = True,
    ) -> DeviceRunner:
        """The executor of an engine on CUDA, graphs captured unless `enforce_eager` or
        not `graphs` (a pipeline stage: a graph captures the whole model's step)."""
        sizes: list[int] = []
        if graphs and not config.enforce_eager:
            load_triton_kernels()  # compiles nothing yet; the warm-up runs compile
            blockers = graph_blockers(kv_cache.storage.device)
            if blockers:
                log.warning(
                    "CUDA graphs disabled: %s run as torch references here", ", ".join(blockers)
                )
            else:
                sizes = capture_sizes(config.max_num_seqs, config.cuda_graph_sizes)
        executor = cls(model, kv_cache, max_model_len, sizes)
        executor.prepare()
        return executor

    def prepare(self) -> None:
        """Warm up and capture the decode graphs (call once, after the KV cache exists)."""
        if self.graphs is not None:
            self.graphs.prepare()

    @torch.inference_mode()
    def execute(self, step: Step) -> Tensor:
        """Logits [num_samples, vocab] float32 on the device."""
        if self.graphs is not None and self.graphs.can_run(step.meta):
            return self.graphs.run(step.token_ids, step.positions, step.meta, step.logits_indices)
        return self.execute_eagerly(step)

    @torch.inference_mode()
    def execute_eagerly(self, step: Step) -> Tensor:
        step = self.stage(step)
        hidden = self.model(step.token_ids, step.positions, self.kv_cache.layers, step.meta)
        if step.logits_indices.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[step.logits_indices])

    def stage(self, step: S) -> S:
        """A copy of `step` whose tensors are on the device (views valid until the next
        call): what every eager step, and each micro-batch of a pipeline stage, runs on."""
        meta = step.meta
        token_ids, positions, slots, tables, starts, lens, indices = self.stager.stage(
            [
                step.token_ids,
                step.positions,
                meta.slot_mapping,
                meta.block_tables,
                meta.query_start_loc,
                meta.context_lens,
                step.logits_indices,
            ]
        )
        meta = dataclasses.replace(
            meta,
            slot_mapping=slots,
            block_tables=tables,
            query_start_loc=starts,
            context_lens=lens,
        )
        return dataclasses.replace(
            step, token_ids=token_ids, positions=positions, meta=meta, logits_indices=indices
        )
