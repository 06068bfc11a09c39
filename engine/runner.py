"""Runs one scheduled step: flattens the chunks into a token batch, runs the model
over the paged KV cache, and returns the logits of the positions that sample."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.kernels import AttentionMetadata
from pdserve.scheduler.outputs import ScheduledChunk, SchedulerOutput
from pdserve.scheduler.request import Request

Tensor = torch.Tensor


@dataclass
class StepBatch:
    token_ids: Tensor  # [num_tokens] int64
    positions: Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: Tensor  # [num_samples]: rows of the batch whose next token is sampled
    sampling_requests: list[Request]  # in logits_indices order
    num_prompt_tokens: int  # prompt tokens computed (not served from the prefix cache)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device_executor = None  # set by the engine on CUDA: `pdserve.engine.device_executor`

    def prepare(self, output: SchedulerOutput) -> StepBatch:
        # Single-token chunks first: the attention op takes decodes before prefills.
        chunks = sorted(output.chunks, key=lambda c: c.num_new_tokens != 1)
        num_decodes = sum(1 for c in chunks if c.num_new_tokens == 1)
        bs = self.block_size
        lens = np.array([c.num_new_tokens for c in chunks], dtype=np.int64)
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        ends = starts + lens
        query_start = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(lens, out=query_start[1:])
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        width = max(-(-int(e) // bs) for e in ends)
        tables = np.zeros((len(chunks), width), dtype=np.int64)
        for row, chunk in enumerate(chunks):
            blocks = chunk.block_ids[: -(-chunk.end // bs)]
            tables[row, : len(blocks)] = blocks
        seq_of_token = np.repeat(np.arange(len(chunks)), lens)
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        token_ids = self._gather_tokens(chunks)
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(tables.astype(np.int32)),
            query_start_loc=torch.from_numpy(query_start.astype(np.int32)),
            context_lens=torch.from_numpy(ends.astype(np.int32)),
            num_decode_seqs=num_decodes,
            max_query_len=int(lens.max()),
            max_context_len=int(ends.max()),
            sliding_window=self.model.sliding_window,
        )
        return StepBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.long),
            positions=torch.from_numpy(positions),
            meta=meta,
            logits_indices=torch.from_numpy(query_start[1:][sampling] - 1),
            sampling_requests=[chunks[i].request for i in sampling],
            num_prompt_tokens=sum(
                max(0, min(c.end, c.request.num_prompt_tokens) - c.start) for c in chunks
            ),
        )

    @staticmethod
    def _gather_tokens(chunks: list[ScheduledChunk]) -> list[int]:
        tokens: list[int] = []
        for c in chunks:
            if c.num_new_tokens == 1:
                tokens.append(c.request.token_at(c.start))
            else:
                tokens.extend(c.request.tokens_between(c.start, c.end))
        return tokens

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> Tensor:
        """Logits [num_samples, vocab] in float32."""
        if self.device_executor is not None:
            return self.device_executor.execute(batch)
        hidden = self.model(batch.token_ids, batch.positions, self.kv_cache.layers, batch.meta)
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.logits_indices])
