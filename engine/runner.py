"""Runs one scheduled step: flattens the chunks into a token batch, runs the model
over the paged KV cache, and returns the logits of the positions that sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.common.request import Request
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.step_inputs import StepInputs, attention_inputs
from pdserve.scheduler.outputs import ScheduledChunk

if TYPE_CHECKING:
    from pdserve.engine.cpu_decode import CpuDecodeSteps
    from pdserve.engine.device_runner import DeviceRunner
    from pdserve.engine.models.llama import LlamaForCausalLM

Tensor = torch.Tensor


@dataclass(frozen=True)
class PromptSpan:
    """Prompt tokens [first, first + count) of a request scored in this step (the rows
    of the positions before them predict them)."""

    request: Request
    first: int
    count: int

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_token_ids[self.first : self.first + self.count]


@dataclass
class StepBatch(StepInputs):
    # logits_indices holds the sampling rows (in this order), then the prompt spans' rows.
    sampling_requests: list[Request]
    prompt_spans: list[PromptSpan] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device_runner: DeviceRunner | None = None  # set by the engine on CUDA
        self.cpu_steps: CpuDecodeSteps | None = None  # set by the engine on CPU

    def prepare(self, scheduled: list[ScheduledChunk]) -> StepBatch:
        # Single-token chunks first: the attention op takes decodes before prefills.
        chunks = sorted(scheduled, key=lambda c: c.num_new_tokens != 1)
        num_decodes = sum(1 for c in chunks if c.num_new_tokens == 1)
        bs = self.block_size
        lens = np.array([c.num_new_tokens for c in chunks], dtype=np.int64)
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        width = max(-(-c.end // bs) for c in chunks)
        tables = np.zeros((len(chunks), width), dtype=np.int64)
        for row, chunk in enumerate(chunks):
            blocks = chunk.block_ids[: -(-chunk.end // bs)]
            tables[row, : len(blocks)] = blocks
        positions, meta, query_start = attention_inputs(
            lens, starts, tables, bs, num_decodes, self.model.sliding_window
        )
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        spans, prompt_rows = self._prompt_rows(chunks, query_start)
        return StepBatch(
            token_ids=torch.tensor(self._gather_tokens(chunks), dtype=torch.long),
            positions=torch.from_numpy(positions),
            meta=meta,
            logits_indices=torch.from_numpy(
                np.concatenate([query_start[1:][sampling] - 1, *prompt_rows])
            ),
            sampling_requests=[chunks[i].request for i in sampling],
            prompt_spans=spans,
        )

    @staticmethod
    def _prompt_rows(
        chunks: list[ScheduledChunk], query_start: np.ndarray
    ) -> tuple[list[PromptSpan], list[np.ndarray]]:
        """The spans of prompt tokens this step scores, and the batch rows predicting
        them: positions [start, min(end, n - 1)) of a chunk predict tokens start + 1 on
        (the last prompt position predicts the first output token: that is sampling)."""
        spans, rows = [], []
        for i, chunk in enumerate(chunks):
            request = chunk.request
            last = min(chunk.end, request.num_prompt_tokens - 1)
            if not request.computes_prompt_logprobs or last <= chunk.start:
                continue
            count = last - chunk.start
            spans.append(PromptSpan(request, chunk.start + 1, count))
            rows.append(np.arange(query_start[i], query_start[i] + count, dtype=np.int64))
        return spans, rows

    @staticmethod
    def _gather_tokens(chunks: list[ScheduledChunk]) -> list[int]:
        tokens: list[int] = []
        for c in chunks:
            if c.num_new_tokens == 1:
                tokens.append(c.request.token_at(c.start))
            else:
                tokens.extend(c.request.tokens_between(c.start, c.end))
        return tokens

    def on_device(self, batch: StepBatch) -> StepBatch:
        """The batch with its tensors where the model is: staged by the device runner on
        CUDA; on CPU, where `prepare` made them."""
        return batch if self.device_runner is None else self.device_runner.stage(batch)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> Tensor:
        """Logits [len(logits_indices), vocab] in float32."""
        if self.device_runner is not None and batch.prompt_spans:
            return self.device_runner.execute_eagerly(batch)  # graphs sample one row a request
        if self.device_runner is not None:
            return self.device_runner.execute(batch)
        steps = self.cpu_steps
        if (
            steps is not None
            and not batch.prompt_spans
            and batch.logits_indices.numel()
            and steps.can_run(batch.meta)
        ):
            logits = steps.run(batch.token_ids, batch.positions, batch.meta, batch.logits_indices)
            if logits is not None:
                return logits
        hidden = self.model(batch.token_ids, batch.positions, self.kv_cache.layers, batch.meta)
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.logits_indices])
