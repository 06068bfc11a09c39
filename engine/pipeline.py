"""Pipeline parallelism: which layers a rank's stage holds, the point-to-point sends
that carry hidden states (and residuals) from stage to stage, and a step run as
micro-batches so the stages overlap.

A group of `tp * pp` ranks is one torch.distributed process group (gloo on CPU, NCCL on
GPU); global rank = stage * tp + tp_rank. Each stage's TP ranks all-reduce within a
sub-group of their own. Every TP rank of a stage holds the whole hidden state after its
all-reduces, so TP rank r of stage s sends to TP rank r of stage s + 1.

Within a step the scheduled chunks split into up to `pp` micro-batches (whole requests,
balanced by tokens). Each stage runs them in order, receiving micro-batch m from the
stage before and sending it on without waiting (`isend`): stage s works on m + 1 while
stage s + 1 works on m. The last stage samples; it then broadcasts the step's tokens so
every rank's request mirrors (and the first stage's next embeddings) agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pdserve.common.model_split import stage_layers
from pdserve.engine.parallel import CollectiveClock, TensorParallel
from pdserve.engine.rendezvous import bind_collectives, join_store

if TYPE_CHECKING:  # annotations only: the model (models/llama.py) imports this module,
    # and the GPU check runs the model with torch alone (no msgspec there)
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.step_plan import SampledToken
    from pdserve.engine.worker import ModelWorker
    from pdserve.scheduler.outputs import ScheduledChunk

Tensor = torch.Tensor


@dataclass(frozen=True)
class PipelineStage:
    """This rank's stage: its layers [layer_start, layer_end) of `num_model_layers`."""

    stage: int = 0
    size: int = 1
    layer_start: int = 0
    layer_end: int = 0
    num_model_layers: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    # Seconds spent waiting on sends and receives between stages (and the token broadcast).
    clock: CollectiveClock = field(default_factory=CollectiveClock, compare=False)

    @classmethod
    def of(
        cls, num_layers: int, size: int = 1, stage: int = 0, tp_rank: int = 0, tp_size: int = 1
    ) -> PipelineStage:
        start, stop = stage_layers(num_layers, size, stage)
        return cls(
            stage=stage,
            size=size,
            layer_start=start,
            layer_end=stop,
            num_model_layers=num_layers,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def holds_layer(self, index: int) -> bool:
        return self.layer_start <= index < self.layer_end

    @property
    def rank(self) -> int:
        return self.stage * self.tp_size + self.tp_rank

    @property
    def sampling_rank(self) -> int:
        """The rank whose sampled tokens (and logprobs) the driver takes."""
        return (self.size - 1) * self.tp_size

    # ---- between stages ---------------------------------------------------------------

    def send(self, x: Tensor) -> Any:
        """To the same TP rank of the next stage, without waiting (returns the work)."""
        return dist.isend(x.contiguous(), dst=self.rank + self.tp_size)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        started = time.perf_counter()
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src=self.rank - self.tp_size)
        self.clock.seconds += time.perf_counter() - started
        return x

    def wait(self, works: list[Any]) -> None:
        started = time.perf_counter()
        for work in works:
            work.wait()
        self.clock.seconds += time.perf_counter() - started

    def share_tokens(self, tokens: list[int], count: int, device: torch.device) -> list[int]:
        """The last stage's `count` sampled tokens, on every rank of the group."""
        started = time.perf_counter()
        buffer = torch.tensor(tokens if self.is_last else [0] * count, dtype=torch.long)
        buffer = buffer.to(device)
        dist.broadcast(buffer, src=self.sampling_rank)
        self.clock.seconds += time.perf_counter() - started
        return buffer.tolist()

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the whole group (e.g. KV blocks: every stage needs
        the same block ids, whatever its layer count)."""
        buffer = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(buffer, op=dist.ReduceOp.MIN)
        return int(buffer.item())


def join_group(
    config: EngineConfig, rank: int, master: str, timeout_s: float
) -> tuple[EngineConfig, TensorParallel, PipelineStage | None]:
    """Joins the group's process group as `rank` (the driver's `rendezvous.Rendezvous`
    at `master`, host:port, its collectives bound to the same interface); returns the
    rank's config, its TP place (with its stage's sub-group) and, with PP, its stage.
    The rank's device is already in its config (the rank launcher's)."""
    from pdserve.engine.checkpoint import load_model_config
    from pdserve.engine.embedded import embedded_model_path

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    backend = "gloo" if config.device == "cpu" else "nccl"
    bind_collectives(master.rsplit(":", 1)[0])
    timeout = timedelta(seconds=timeout_s)
    store = join_store(master, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=tp * pp, timeout=timeout)
    if pp == 1:
        return config, TensorParallel(rank, tp), None
    # Every rank creates every stage's sub-group, in the same order (torch requires it).
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    stage_index, tp_rank = divmod(rank, tp)
    num_layers = load_model_config(config.model or embedded_model_path()).num_hidden_layers
    stage = PipelineStage.of(num_layers, pp, stage_index, tp_rank, tp)
    return config, TensorParallel(tp_rank, tp, group=groups[stage_index]), stage


def micro_batches(chunks: list[ScheduledChunk], count: int) -> list[list[ScheduledChunk]]:
    """Up to `count` runs of whole chunks in order, each cut once it holds its share of
    the tokens (every rank cuts the same plan the same way)."""
    count = min(count, len(chunks))
    share = sum(c.num_new_tokens for c in chunks) / max(1, count)
    groups: list[list[ScheduledChunk]] = [[]]
    tokens = 0
    for index, chunk in enumerate(chunks):
        groups_left = count - len(groups)
        full = tokens >= share * len(groups) or len(chunks) - index <= groups_left
        if groups[-1] and groups_left and full:
            groups.append([])
        groups[-1].append(chunk)
        tokens += chunk.num_new_tokens
    return groups


@torch.inference_mode()
def run_stage(worker: ModelWorker, chunks: list[ScheduledChunk]) -> list[SampledToken]:
    """This rank's part of a step: each micro-batch through its layers, received from
    the stage before and sent on; the last stage samples, every rank learns the tokens."""
    stage, model = worker.stage, worker.model
    hidden_size = model.cfg.hidden_size
    sends: list[Any] = []
    in_flight: list[Tensor] = []  # what the sends read, alive until they complete
    sampled: list[SampledToken] = []
    sampling = []
    for group in micro_batches(chunks, stage.size):
        batch = worker.runner.on_device(worker.runner.prepare(group))
        carried = None  # received onto the device, where the model and the batch are
        if not stage.is_first:
            shape = (2, batch.num_tokens, hidden_size)
            carried = stage.recv(shape, model.hidden_dtype, worker.device)
        began = worker.forward_began()
        out = model(batch.token_ids, batch.positions, worker.kv_cache.layers, batch.meta, carried)
        sampling.extend(batch.sampling_requests)
        if not stage.is_last:
            worker.forward_ended(began)
            sends.append(stage.send(out))
            in_flight.append(out)
        elif batch.logits_indices.numel():  # rows to sample, or prompt tokens to score
            logits = model.compute_logits(out[batch.logits_indices])
            worker.forward_ended(began)
            sampled.extend(worker.take_logits(logits, batch))
        else:
            worker.forward_ended(began)
    stage.wait(sends)
    if not sampling:
        return []
    tokens = stage.share_tokens([s.token_id for s in sampled], len(sampling), worker.device)
    if not stage.is_last:  # the mirrors of the other stages learn the tokens here
        for request, token in zip(sampling, tokens, strict=True):
            request.output_token_ids.append(token)
    return sampled
