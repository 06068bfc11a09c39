"""Tensor parallelism: which slice of the model a rank holds, and the collectives that
join the slices (torch.distributed: gloo on CPU, NCCL on GPU).

Attention heads split across ranks with their KV heads (each rank keeps whole GQA
groups), the MLP's intermediate dimension splits likewise; the output projection and the
MLP's down projection then each end in one all-reduce. The embedding table and the LM head
split by vocabulary rows (padded to a multiple of the TP size); the logits are gathered
so every rank samples the same token from the same numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pdserve.common.model_split import TensorParallelError, check_tp_size

Tensor = torch.Tensor
__all__ = ["TensorParallel", "TensorParallelError", "check_tp_size"]


@dataclass
class CollectiveClock:
    """Seconds this rank spent in collectives (the share of a step the split costs)."""

    seconds: float = 0.0


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    clock: CollectiveClock = field(default_factory=CollectiveClock, compare=False)
    # The process group of this rank's TP peers (a pipeline stage's); None: the whole group.
    group: Any = field(default=None, compare=False)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def split(self, total: int) -> tuple[int, int]:
        """This rank's [start, stop) of `total` evenly divided rows."""
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def vocab_rows(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, stop, rows per rank) of the vocabulary; the last rank's may be short."""
        per = -(-vocab_size // self.size)
        start = self.rank * per
        return start, min(vocab_size, start + per), per

    def all_reduce(self, x: Tensor) -> Tensor:
        if self.enabled:
            started = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            self.clock.seconds += time.perf_counter() - started
        return x

    def gather_columns(self, x: Tensor) -> Tensor:
        """[n, k] on each rank → [n, k * size], ranks' columns side by side."""
        if not self.enabled:
            return x
        started = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self.clock.seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1)

    def embed(
        self, token_ids: Tensor, table: Tensor | RowTable, vocab_size: int, dtype: torch.dtype
    ) -> Tensor:
        """Rows of a vocabulary-split table (a tensor, or GGUF blocks), in `dtype`: each
        rank looks up its own ids, zeros the rest, and the all-reduce sums the one non-zero
        row of each token."""
        if not self.enabled:
            return _lookup(table, token_ids, dtype)
        start, stop, _ = self.vocab_rows(vocab_size)
        outside = (token_ids < start) | (token_ids >= stop)
        local = torch.where(outside, torch.zeros_like(token_ids), token_ids - start)
        rows = _lookup(table, local, dtype)
        rows = rows.masked_fill(outside[:, None], 0.0)
        return self.all_reduce(rows)


class RowTable(Protocol):
    """A table kept in another form than a tensor (`packed.PackedMatrix`: GGUF blocks)."""

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor: ...


def _lookup(table: Tensor | RowTable, ids: Tensor, dtype: torch.dtype) -> Tensor:
    if isinstance(table, Tensor):
        return torch.nn.functional.embedding(ids, table).to(dtype)
    return table.rows(ids, dtype)
