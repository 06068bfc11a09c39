"""One instance's engine: scheduler + model runner + sampler, stepped by its owner.

The owner (the offline `LLM`, or a prefill/decode instance loop) adds requests and
calls `step()`, which returns the token deltas of that step.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from pdserve.engine import gpu_memory
from pdserve.engine.checkpoint import load_generation_config, load_model_config
from pdserve.engine.config import EngineConfig
from pdserve.engine.device_executor import DeviceExecutor
from pdserve.engine.embedded import embedded_model_path
from pdserve.engine.kv_cache import KVCache, KVCacheShape
from pdserve.engine.loader import load_model
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import Sampler
from pdserve.kernels import dispatch
from pdserve.scheduler.config import SchedulerConfig
from pdserve.scheduler.messages import RequestDelta
from pdserve.scheduler.outputs import SchedulerOutput
from pdserve.scheduler.request import Request, RequestStatus
from pdserve.scheduler.sampling_params import SamplingParams
from pdserve.scheduler.step_scheduler import Scheduler


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0  # every token run through the model, prompt or output
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (cache misses)
    mixed_steps: int = 0  # steps that ran prefill chunks beside decodes
    model_seconds: float = 0.0


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config or EngineConfig.from_kwargs(**kwargs)
        torch.set_num_threads(self.config.resolved_threads())
        self.model_path = str(self.config.model or embedded_model_path())
        self.model_config = load_model_config(self.model_path)
        self.generation_config = load_generation_config(self.model_path)
        self.dtype = self.config.torch_dtype(self.model_config.torch_dtype)
        self.device = torch.device(self.config.device)
        on_cuda = self.device.type == "cuda"
        free_before_load = gpu_memory.free_device_memory(self.device) if on_cuda else 0
        self.model = load_model(self.model_path, self.model_config, self.dtype, self.device)
        mc = self.model_config
        self.max_model_len = min(
            self.config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        shape = KVCacheShape(
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            block_size=self.config.block_size,
            dtype=self.dtype,
        )
        if self.config.num_kv_blocks:
            num_blocks = self.config.num_kv_blocks
        elif on_cuda:
            profile = gpu_memory.profile_memory(
                self.model,
                shape,
                self.device,
                free_before_load,
                min(self.config.max_num_batched_tokens, self.max_model_len),
                self.config.max_num_seqs,
            )
            kv_bytes = gpu_memory.kv_cache_bytes(profile, self.config.gpu_memory_utilization)
            num_blocks = kv_bytes // shape.bytes_per_block
        else:
            num_blocks = shape.num_blocks_for(self.config.kv_cache_memory)
        self.kv_cache = KVCache(shape, num_blocks, self.device)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=self.config.block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=self.config.enable_prefix_caching,
                enable_chunked_prefill=self.config.enable_chunked_prefill,
            )
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.config.block_size)
        if on_cuda:  # decode graphs are captured here, once the KV cache exists
            self.runner.device_executor = DeviceExecutor.for_engine(
                self.model, self.kv_cache, self.config, self.max_model_len
            )
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(self.generation_config.eos_token_ids) | frozenset(
            mc.eos_token_ids
        )
        self.stats = EngineStats()
        self._seeds = random.Random(self.config.seed)

    # ---- requests -------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str = "",
        arrival_time: float | None = None,
    ) -> Request:
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt holds token id {bad[0]} outside the vocabulary")
        seed = sampling_params.seed
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            seed=self._seeds.getrandbits(63) if seed is None else seed,
        )

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def finish_request(self, request_id: str) -> None:
        """Ends a request whose text matched a stop string (the front end decides)."""
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    def kernels_status(self) -> str:
        """Which kernels this engine's attention and fused ops run on."""
        if self.device.type == "cuda":
            reason = dispatch.triton_unavailable_reason()
            return "Triton" if reason is None else f"torch references ({reason})"
        return dispatch.cpu_kernels_status()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- stepping -------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        return self.execute(self.scheduler.schedule())

    def execute(self, output: SchedulerOutput) -> list[RequestDelta]:
        """Runs a step the scheduler planned. Owners that act on the plan itself (a
        decode instance pulls the KV of `output.remote_kv_allocations`, which a step
        can carry while computing nothing) call `scheduler.schedule()` and then this."""
        if output.is_empty:
            return []
        batch = self.runner.prepare(output)
        started = time.perf_counter()
        logits = self.runner.execute(batch)
        tokens, logprobs = [], []
        if batch.sampling_requests:  # a step of mid-prompt chunks samples nothing
            tokens, logprobs = self.sampler.sample(logits, batch.sampling_requests)
        self.stats.model_seconds += time.perf_counter() - started
        self._count(batch)
        sampled = {r.request_id: t for r, t in zip(batch.sampling_requests, tokens, strict=True)}
        self.scheduler.update_from_output(output, sampled)
        deltas = []
        for req, tok, lp in zip(batch.sampling_requests, tokens, logprobs, strict=True):
            status = req.status
            deltas.append(
                RequestDelta(
                    request_id=req.request_id,
                    new_token_ids=[tok],
                    output_index=req.num_output_tokens - 1,
                    logprobs=None if lp is None else [lp],
                    finish_reason=status.finish_reason if status.finished else None,
                    stop_reason=req.stop_reason if status.finished else None,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
        return deltas

    def _count(self, batch) -> None:
        self.stats.steps += 1
        self.stats.tokens_computed += batch.num_tokens
        self.stats.prompt_tokens_computed += batch.num_prompt_tokens
        decodes = batch.meta.num_decode_seqs
        if decodes and batch.meta.num_seqs > decodes:
            self.stats.mixed_steps += 1
