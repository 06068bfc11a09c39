"""Decode steps replayed from CUDA graphs.

A decode step of a large model launches hundreds of small kernels; at small batches
the CPU cannot launch them as fast as the GPU runs them. So pure-decode batches (every
sequence one new token) run from graphs captured once per batch size in a fixed set;
a batch is padded up to the next captured size. Everything a graph reads lives in
static buffers (`DecodeInputBuffers`): token ids, positions, slot mapping, block
tables of a fixed width (max_model_len / block_size, so the decode kernel's split-K
plan, which follows the table width, is the same at capture and at replay), context
lengths. Padding rows write nothing to the KV cache (slot -1) and attend to nothing
(context length 0). The logits of a replay land in one static buffer shared by all
graphs. The graphs share one memory pool and are captured largest first, so the
smaller ones reuse the largest one's activation memory.

The same class runs without capturing (`capture=False`): each "graph" is then a plain
call of the model on the static buffers. That is how CPU tests check the padding and
buffer logic; CUDA replays only add the capture on top.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from pdserve.kernels import AttentionMetadata, dispatch, reference

if TYPE_CHECKING:
    from pdserve.engine.models.llama import LlamaForCausalLM

Tensor = torch.Tensor
# Kernels one decode step runs; each must be its Triton version (no host syncs) to capture.
DECODE_KERNELS = (
    "write_kv_cache",
    "decode_attention",
    "rms_norm",
    "rotary_embedding",
    "rotary_write_kv_cache",
)
MAX_DEFAULT_SIZE = 512


def capture_sizes(max_num_seqs: int, requested: Sequence[int] | None = None) -> list[int]:
    """Batch sizes to capture, ascending. Default: 1, 2, 4, 8, then every 8 up to 256
    and every 16 up to 512, cut at max_num_seqs (which is added when it falls between)."""
    if requested is not None:
        return sorted({s for s in requested if 1 <= s <= max_num_seqs})
    defaults = [1, 2, 4, *range(8, 257, 8), *range(272, MAX_DEFAULT_SIZE + 1, 16)]
    sizes = [s for s in defaults if s <= max_num_seqs]
    if max_num_seqs <= MAX_DEFAULT_SIZE and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


def graph_blockers(device: torch.device) -> list[str]:
    """Decode kernels that would run as torch references on `device` (they synchronise
    with the host, which a capture forbids); empty when all are Triton kernels."""
    probe = torch.empty(0, device=device)
    return [
        name
        for name in DECODE_KERNELS
        if dispatch.lookup(name, probe) is getattr(reference, f"{name}_ref")
    ]


class DecodeInputBuffers:
    """The static inputs of the decode graphs and how a step's batch is staged in them.

    Device buffers hold `max_size` rows; a graph of size n reads rows [:n]. Host
    mirrors (pinned) are filled with numpy and copied with non-blocking copies; on a
    CPU device the mirrors are the buffers themselves.
    """

    def __init__(
        self,
        max_size: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        sliding_window: int | None = None,
    ):
        self.max_size = max_size
        self.width = max_blocks_per_seq
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device
        self.buffers = self._allocate(device, pin=False)
        on_cpu = device.type == "cpu"
        self.host = self.buffers if on_cpu else self._allocate(torch.device("cpu"), pin=True)
        self.host_arrays = {name: t.numpy() for name, t in self.host.items()}
        self._copied = None if on_cpu else torch.cuda.Event()

    def _allocate(self, device: torch.device, pin: bool) -> dict[str, Tensor]:
        n = self.max_size

        def zeros(*shape: int, dtype: torch.dtype) -> Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device, pin_memory=pin)

        buffers = {
            "token_ids": zeros(n, dtype=torch.int64),
            "positions": zeros(n, dtype=torch.int64),
            "slot_mapping": torch.full((n,), -1, dtype=torch.int64, device=device, pin_memory=pin),
            "context_lens": zeros(n, dtype=torch.int32),
            # Entries past a row's context are ignored but must be valid block ids:
            # zeros at first, later stale ids of earlier steps.
            "block_tables": zeros(n, self.width, dtype=torch.int32),
            "logits_indices": zeros(n, dtype=torch.int64),
        }
        # Decode: sequence i owns query row i, padding rows included; never changes.
        buffers["query_start_loc"] = torch.arange(n + 1, dtype=torch.int32, device=device)
        return buffers

    def views(self, size: int) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """(token_ids, positions, metadata) of the first `size` rows, on the device."""
        b = self.buffers
        meta = AttentionMetadata(
            slot_mapping=b["slot_mapping"][:size],
            block_tables=b["block_tables"][:size],
            query_start_loc=b["query_start_loc"][: size + 1],
            context_lens=b["context_lens"][:size],
            num_decode_seqs=size,
            max_query_len=1,
            max_context_len=self.width * self.block_size,
            sliding_window=self.sliding_window,
        )
        return b["token_ids"][:size], b["positions"][:size], meta

    def stage(
        self,
        token_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        logits_indices: Tensor,
        size: int,
    ) -> Tensor:
        """Writes a decode batch of k <= size sequences (CPU tensors) into rows [:k],
        padding into rows [k:size]; returns the device view of its logits indices."""
        k, width = meta.num_seqs, meta.block_tables.shape[1]
        if not k <= size <= self.max_size or width > self.width:
            raise ValueError(
                f"a batch of {k} sequences x {width} blocks does not fit a graph of "
                f"{size} rows (at most {self.max_size} rows x {self.width} blocks)"
            )
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the mirrors
        h = self.host_arrays
        h["token_ids"][:k] = token_ids.numpy()
        h["token_ids"][k:size] = 0
        h["positions"][:k] = positions.numpy()
        h["positions"][k:size] = 0
        h["slot_mapping"][:k] = meta.slot_mapping.numpy()
        h["slot_mapping"][k:size] = -1
        h["context_lens"][:k] = meta.context_lens.numpy()
        h["context_lens"][k:size] = 0
        h["block_tables"][:k, :width] = meta.block_tables.numpy()
        num_samples = logits_indices.shape[0]
        h["logits_indices"][:num_samples] = logits_indices.numpy()
        if self._copied is not None:
            self._copy_rows(size, k, num_samples)
            self._copied.record()
        return self.buffers["logits_indices"][:num_samples]

    def stage_padding(self, size: int) -> None:
        """Rows [:size] all padding: what warm-up and capture run on."""
        empty = torch.zeros(0, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_mapping=empty,
            block_tables=torch.zeros(0, 0, dtype=torch.int32),
            query_start_loc=torch.zeros(1, dtype=torch.int32),
            context_lens=torch.zeros(0, dtype=torch.int32),
            num_decode_seqs=0,
            max_query_len=0,
            max_context_len=0,
        )
        self.stage(empty, empty, meta, empty, size)

    def _copy_rows(self, size: int, k: int, num_samples: int) -> None:
        for name in ("token_ids", "positions", "slot_mapping", "context_lens"):
            self.buffers[name][:size].copy_(self.host[name][:size], non_blocking=True)
        # Rows past k keep their stale (valid) ids: context length 0 ignores them.
        self.buffers["block_tables"][:k].copy_(self.host["block_tables"][:k], non_blocking=True)
        self.buffers["logits_indices"][:num_samples].copy_(
            self.host["logits_indices"][:num_samples], non_blocking=True
        )


class DecodeGraphs:
    """Decode steps of `model` for a fixed set of batch sizes, captured or plain."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[Tensor],
        sizes: Sequence[int],
        max_blocks_per_seq: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        capture: bool,
    ):
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one batch size")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.capture = capture
        self.device = device
        self.inputs = DecodeInputBuffers(
            self.sizes[-1], max_blocks_per_seq, block_size, device, model.sliding_window
        )
        self.logits = torch.zeros(self.sizes[-1], vocab_size, dtype=torch.float32, device=device)
        self._steps: dict[int, Callable[[], object]] = {}
        self._graphs: list[torch.cuda.CUDAGraph] = []

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def prepare(self) -> None:
        """Warm up every size (compiling its kernels), then capture it, largest first."""
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        for size in reversed(self.sizes):
            self.inputs.stage_padding(size)
            self._forward(size)
            if not self.capture:
                self._steps[size] = partial(self._forward, size)
                continue
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            self._graphs.append(graph)
            self._steps[size] = graph.replay
        if self.capture:
            torch.cuda.synchronize(self.device)

    def _forward(self, size: int) -> None:
        token_ids, positions, meta = self.inputs.views(size)
        hidden = self.model(token_ids, positions, self.kv_caches, meta)
        self.logits[:size].copy_(self.model.compute_logits(hidden))

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds `num_seqs` rows, or None."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Pure decode (one token per sequence), within the largest size and table width."""
        n = meta.num_seqs
        return (
            bool(self._steps)
            and 0 < n <= self.max_size
            and meta.num_decode_seqs == n
            and meta.slot_mapping.shape[0] == n
            and meta.block_tables.shape[1] <= self.inputs.width
        )

    def run(self, token_ids: Tensor, positions: Tensor, meta: AttentionMetadata, logits_indices):
        """Logits [num_samples, vocab] float32 on the device (a fresh tensor)."""
        size = self.padded_size(meta.num_seqs)
        if size is None:  # callers ask can_run first
            raise ValueError(f"{meta.num_seqs} sequences: over the largest graph, {self.max_size}")
        indices = self.inputs.stage(token_ids, positions, meta, logits_indices, size)
        self._steps[size]()
        return self.logits.index_select(0, indices)

    def replay_staged(self, size: int) -> None:
        """Runs the step of `size` on whatever the buffers hold (benchmarks time this)."""
        self._steps[size]()
