"""Step inputs built from plain token lists, without the scheduler.

The GPU memory profile and the device benchmarks drive the model directly: sequence i
owns row i of a block table, and a step hands each sequence a chunk of new tokens that
starts at some position. The layout follows `ModelRunner.prepare`: one-token chunks
(decodes) come first, block tables are trimmed to the longest context, and every
chunk samples from its last token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from pdserve.kernels import AttentionMetadata

Tensor = torch.Tensor


@dataclass
class StepInputs:
    """What `DeviceRunner.execute` reads from a step (as `runner.StepBatch` holds)."""

    token_ids: Tensor  # [num_tokens] int64
    positions: Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: Tensor  # [num_samples] int64: rows of the batch whose logits are wanted


def inputs_on(inputs: StepInputs, device: torch.device | str) -> StepInputs:
    """A copy of `inputs` with every tensor on `device` (one-off steps: a memory profile,
    a calibration prefill; steps the engine runs go through `DeviceRunner.stage`)."""
    meta = inputs.meta
    on_device = replace(
        meta,
        slot_mapping=meta.slot_mapping.to(device),
        block_tables=meta.block_tables.to(device),
        query_start_loc=meta.query_start_loc.to(device),
        context_lens=meta.context_lens.to(device),
    )
    return StepInputs(
        inputs.token_ids.to(device),
        inputs.positions.to(device),
        on_device,
        inputs.logits_indices.to(device),
    )


def contiguous_block_tables(num_seqs: int, blocks_per_seq: int, first_block: int = 0) -> Tensor:
    """[num_seqs, blocks_per_seq] int32: sequence i owns a run of consecutive blocks."""
    ids = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32) + first_block
    return ids.view(num_seqs, blocks_per_seq)


def build_step_inputs(
    chunks: Sequence[tuple[Sequence[int], int]],
    block_tables: Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> StepInputs:
    """chunks[i] = (new token ids, position of the first) of sequence i, whose blocks
    are block_tables[i]. One-token chunks must come before longer ones."""
    if not chunks:
        raise ValueError("a step needs at least one chunk")
    lens = np.array([len(tokens) for tokens, _ in chunks], dtype=np.int64)
    if (lens < 1).any():
        raise ValueError("every chunk needs at least one new token")
    num_decodes = int(np.argmax(lens != 1)) if (lens != 1).any() else len(chunks)
    if (lens[num_decodes:] == 1).any():
        raise ValueError("one-token chunks (decodes) must come before longer chunks")
    starts = np.array([start for _, start in chunks], dtype=np.int64)
    width = int(-(-(starts + lens).max() // block_size))
    if block_tables.shape[0] < len(chunks) or block_tables.shape[1] < width:
        raise ValueError(
            f"block tables {tuple(block_tables.shape)} cannot hold {len(chunks)} sequences "
            f"of up to {int((starts + lens).max())} tokens in blocks of {block_size}"
        )
    tables = block_tables[: len(chunks), :width].numpy().astype(np.int64)
    positions, meta, query_start = attention_inputs(
        lens, starts, tables, block_size, num_decodes, sliding_window
    )
    token_ids = [t for tokens, _ in chunks for t in tokens]
    return StepInputs(
        token_ids=torch.tensor(token_ids, dtype=torch.long),
        positions=torch.from_numpy(positions),
        meta=meta,
        logits_indices=torch.from_numpy(query_start[1:] - 1),
    )


def attention_inputs(
    lens: np.ndarray,
    starts: np.ndarray,
    tables: np.ndarray,
    block_size: int,
    num_decodes: int,
    sliding_window: int | None = None,
) -> tuple[np.ndarray, AttentionMetadata, np.ndarray]:
    """Positions, attention metadata and query start offsets of a step whose sequence
    i computes lens[i] tokens from starts[i] in the blocks of tables[i] (int64 rows,
    wide enough for every chunk's end; decodes first)."""
    ends = starts + lens
    query_start = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start[1:])
    positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
    seq_of_token = np.repeat(np.arange(len(lens)), lens)
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots),
        block_tables=torch.from_numpy(tables.astype(np.int32)),
        query_start_loc=torch.from_numpy(query_start.astype(np.int32)),
        context_lens=torch.from_numpy(ends.astype(np.int32)),
        num_decode_seqs=num_decodes,
        max_query_len=int(lens.max()),
        max_context_len=int(ends.max()),
        sliding_window=sliding_window,
    )
    return positions, meta, query_start
