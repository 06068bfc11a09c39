"""One rank of an executor: the model, its paged KV cache, the runner and the sampler.

The rank mirrors each request the driver's scheduler runs (prompt, output tokens so
far, sampling parameters, block table) from the `StepPlan`s it receives, appends the
tokens it samples, and drops a request when the plan lists it as finished. A KV
connector (the worker half of the KV transfer, given by the instance) sits beside the
KV cache: it starts once the cache exists, gets each plan's connector metadata before
the step runs and reports its finished and failed transfers after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from pdserve.common.model_split import check_int8_groups, check_pp_size
from pdserve.common.request import Request
from pdserve.common.structured_output import StructuredOutput
from pdserve.engine import gpu_memory
from pdserve.engine.checkpoint import (
    CheckpointError,
    ModelConfig,
    load_generation_config,
    load_model_config,
)
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_decode import CpuDecodeSteps
from pdserve.engine.device_runner import DeviceRunner
from pdserve.engine.embedded import served_model_path
from pdserve.engine.executor import RankConnector
from pdserve.engine.grammar import GrammarBook
from pdserve.engine.host_memory import keep_buffers_mapped
from pdserve.engine.kv_cache import KVCache, KVCacheShape
from pdserve.engine.kv_calibration import CALIBRATION_TEXT, calculate_kv_scales
from pdserve.engine.kv_scales import KVScales, read_kv_scales, set_kv_scales
from pdserve.engine.loader import load_model
from pdserve.engine.models.packed import weight_format
from pdserve.engine.parallel import TensorParallel, check_tp_size
from pdserve.engine.pipeline import PipelineStage, run_stage
from pdserve.engine.runner import ModelRunner, StepBatch
from pdserve.engine.sampler import Sampler, describe_rows
from pdserve.engine.step_plan import (
    KVGeometry,
    PromptLogprobs,
    SampledToken,
    StepPlan,
    StepResult,
    WorkerInfo,
)
from pdserve.kernels import dispatch
from pdserve.scheduler.outputs import ScheduledChunk
from pdserve.text.tokenizer import Tokenizer


def _resident_bytes() -> int:
    """This process's resident memory now (Linux), 0 where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _peak_resident_bytes() -> int:
    """This process's resident high-water mark (Linux VmHWM: unlike ru_maxrss it does not
    carry over a parent's peak across fork and exec), 0 where unknown."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def default_model_path(config: EngineConfig) -> Path:
    """The embedded model's files as this configuration serves them (`embedded`)."""
    return served_model_path(config.device, config.dtype, config.quantization)


def model_tokenizer_facts(config: EngineConfig) -> tuple[str, int, list[int]]:
    """What a grammar needs of the model without loading it: the tokenizer's folder, the
    vocabulary size and the end tokens."""
    model_path = str(config.model or default_model_path(config))
    mc = load_model_config(model_path)
    eos = set(load_generation_config(model_path).eos_token_ids) | set(mc.eos_token_ids)
    return config.tokenizer or model_path, mc.vocab_size, sorted(eos)


class ModelWorker:
    def __init__(
        self,
        config: EngineConfig,
        connector: RankConnector | None = None,
        tp: TensorParallel | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        self.config = config
        self.connector = connector
        self.tp = tp or TensorParallel()  # this rank's place in its tensor-parallel group
        self._stage = stage  # its pipeline stage (None: the whole model)
        self.requests: dict[str, Request] = {}
        self.block_tables: dict[str, list[int]] = {}
        self._prompt_logprobs: list[PromptLogprobs] = []  # the current step's
        # The forward's wall time, summed over the step (`collect_model_time`, CPU only:
        # on CUDA the launch returns before the work ends, and a synchronize to time it
        # would stall every step).
        self.times_forward = config.collect_model_time and config.device == "cpu"
        self.forward_seconds = 0.0

    # ---- lifecycle --------------------------------------------------------------------

    def load(self) -> WorkerInfo:
        """Loads the weights, sizes and allocates the KV cache, starts the connector."""
        config = self.config
        rss_before = _resident_bytes()
        torch.set_num_threads(config.resolved_threads())
        self.model_path = str(config.model or default_model_path(config))
        self.model_config = mc = load_model_config(self.model_path)
        self._check_split(mc)
        self.stage = stage = self._stage or PipelineStage.of(mc.num_hidden_layers)
        check_pp_size(stage.size, mc.num_hidden_layers)
        generation_config = load_generation_config(self.model_path)
        self.dtype = config.torch_dtype(mc.torch_dtype)
        self.device = torch.device(config.device)
        on_cuda = self.device.type == "cuda"
        if self.device.type == "cpu":
            keep_buffers_mapped()  # before the weights: prefill buffers reused, not remapped
        model_dtype = str(self.dtype).removeprefix("torch.")
        with gpu_memory.sizing_turn(self.device) if on_cuda else contextlib.nullcontext():
            free_before_load = gpu_memory.free_device_memory(self.device) if on_cuda else 0
            self.model = load_model(
                self.model_path, mc, self.dtype, self.device, self.tp, stage, config.quantization
            )
            self.max_model_len = min(
                config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
            )
            shape, scales = self._kv_shape(mc, stage, model_dtype)
            num_blocks = self._num_blocks(shape, free_before_load)
            if not stage.enabled:
                self.kv_cache = KVCache(shape, num_blocks, self.device)
        if stage.enabled:  # block ids are shared by the stages: the smallest pool bounds them
            # (agreed outside the turn: another stage may wait for this GPU's turn)
            num_blocks = stage.agree_min(num_blocks, self.device)
            self.kv_cache = KVCache(shape, num_blocks, self.device)
        self.runner = self._make_runner(config, stage)
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(generation_config.eos_token_ids) | frozenset(
            mc.eos_token_ids
        )
        self.grammars = GrammarBook(
            config.tokenizer or self.model_path,
            mc.vocab_size,
            sorted(self.eos_token_ids),
            compile_timeout_s=config.grammar_compile_timeout_s,
        )
        geometry = KVGeometry(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            block_size=shape.block_size,
            dtype=str(shape.dtype).removeprefix("torch."),
            num_blocks=self.kv_cache.num_blocks,
            first_layer=stage.layer_start,
            model_layers=mc.num_hidden_layers,
            pipeline_stage=stage.stage,
            pipeline_parallel_size=stage.size,
            k_scales=scales.k if scales is not None else [],
            v_scales=scales.v if scales is not None else [],
        )
        addresses = []
        if self.connector is not None:
            addresses.append(self.connector.start(self.kv_cache.storage, geometry))
        return WorkerInfo(
            model_path=self.model_path,
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=sorted(self.eos_token_ids),
            generation_defaults=self._generation_defaults(generation_config.defaults),
            kernels=self._kernels_status(),
            kv=geometry,
            connector_addresses=addresses,
            weight_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters()),
            load_peak_memory_bytes=max(0, _peak_resident_bytes() - rss_before),
            weight_format=weight_format(self.model),
            dtype=model_dtype,
        )

    def _make_runner(self, config: EngineConfig, stage: PipelineStage) -> ModelRunner:
        """The step runner, once the KV cache exists: on CUDA with its decode graphs
        (whole model only: a pipeline stage stages its inputs through the device runner
        and runs eagerly), on CPU with small decode batches as one C call each."""
        runner = ModelRunner(self.model, self.kv_cache, config.block_size)
        if self.device.type == "cuda":
            runner.device_runner = DeviceRunner.for_engine(
                self.model, self.kv_cache, config, self.max_model_len, graphs=not stage.enabled
            )
        elif not config.enforce_eager:
            runner.cpu_steps = CpuDecodeSteps.for_model(
                self.model,
                self.kv_cache.layers,
                config.max_num_seqs,
                self.max_model_len,
                config.block_size,
            )
        return runner

    def _kv_shape(
        self, mc: ModelConfig, stage: PipelineStage, model_dtype: str
    ) -> tuple[KVCacheShape, KVScales | None]:
        """This rank's KV cache in the model's dtype or FP8; an FP8 cache's layers get
        their scales (the checkpoint's, else 1)."""
        kv_dtype = self.config.kv_dtype_name(model_dtype)
        shape = KVCacheShape(
            num_layers=stage.num_layers,  # a stage's cache holds only its layers
            num_kv_heads=mc.num_key_value_heads // self.tp.size,
            head_dim=mc.head_dim,
            block_size=self.config.block_size,
            dtype=getattr(torch, kv_dtype),
        )
        scales = None
        if kv_dtype != model_dtype:
            if self.config.calculate_kv_scales:
                scales = self._calculate_kv_scales(shape)
            else:
                scales = read_kv_scales(self.model_path, mc.num_hidden_layers)
            set_kv_scales(self.model.layers, scales)
        return shape, scales

    def _calculate_kv_scales(self, fp8_shape: KVCacheShape) -> KVScales:
        """Scales for `fp8_shape`'s cache, from a calibration prefill into a scratch cache
        of the model's own dtype."""
        tokenizer = Tokenizer.from_folder(self.config.tokenizer or self.model_path)
        token_ids = tokenizer.encode(CALIBRATION_TEXT)
        scratch = dataclasses.replace(fp8_shape, dtype=self.dtype)
        return calculate_kv_scales(
            self.model, token_ids, scratch, fp8_shape.dtype, self.device, self.tp
        )

    def _check_split(self, mc: ModelConfig) -> None:
        """The model's shapes split this rank's way (an int8 split keeps groups whole)."""
        tp = self.tp.size
        check_tp_size(tp, mc.num_attention_heads, mc.num_key_value_heads, mc.intermediate_size)
        if self.config.quantization == "int8":
            attention_width = mc.num_attention_heads * mc.head_dim
            check_int8_groups(tp, mc.hidden_size, attention_width, mc.intermediate_size)

    def _generation_defaults(self, checkpoint: dict[str, int | float]) -> dict[str, int | float]:
        source = self.config.generation_config
        if source == "auto":
            return dict(checkpoint)
        if source == "vllm":
            return {}
        if not (Path(source).expanduser() / "generation_config.json").is_file():
            raise CheckpointError(f"generation config {source}: no generation_config.json there")
        return dict(load_generation_config(Path(source).expanduser()).defaults)

    def _num_blocks(self, shape: KVCacheShape, free_before_load: int) -> int:
        config = self.config
        if config.num_kv_blocks:
            return config.num_kv_blocks
        if self.device.type != "cuda":
            return shape.num_blocks_for(config.kv_cache_memory)
        profile = gpu_memory.profile_memory(
            self.model,
            shape,
            self.device,
            free_before_load,
            min(config.max_num_batched_tokens, self.max_model_len),
            config.max_num_seqs,
        )
        return gpu_memory.kv_cache_bytes(profile, config.gpu_memory_utilization) // (
            shape.bytes_per_block
        )

    def _kernels_status(self) -> str:
        if self.device.type == "cuda":
            reason = dispatch.triton_unavailable_reason()
            return "Triton" if reason is None else f"torch references ({reason})"
        return dispatch.cpu_kernels_status()

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.close()
        if hasattr(self, "grammars"):
            self.grammars.shutdown()

    def prepare_grammar(self, spec: StructuredOutput) -> Future[Any]:
        return self.grammars.prepare(spec)

    # ---- stepping ---------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """A plan that carries connector metadata gets the connector's report back; one
        without it leaves the report for the next plan that does."""
        self._update_requests(plan)
        connector = self.connector if plan.kv_connector is not None else None
        if connector is not None:
            connector.apply(plan.kv_connector)
        in_collectives, in_sends = self.tp.clock.seconds, self.stage.clock.seconds
        self._prompt_logprobs = []
        self.forward_seconds = 0.0
        sampled = self._run(plan) if plan.chunks else []
        reports = [connector.report()] if connector is not None else []
        return StepResult(
            sampled=sampled,
            prompt_logprobs=self._prompt_logprobs,
            kv_reports=reports,
            collective_seconds=self.tp.clock.seconds - in_collectives,
            stage_transfer_seconds=self.stage.clock.seconds - in_sends,
            forward_seconds=self.forward_seconds if self.times_forward else None,
        )

    def forward_began(self) -> float:
        """Where a timed forward starts (0.0 when the forward is not timed)."""
        return time.perf_counter() if self.times_forward else 0.0

    def forward_ended(self, began: float) -> None:
        if self.times_forward:
            self.forward_seconds += time.perf_counter() - began

    def _update_requests(self, plan: StepPlan) -> None:
        for request_id in plan.finished_ids:
            self.requests.pop(request_id, None)
            self.block_tables.pop(request_id, None)
            self.grammars.drop(request_id)
        for new in plan.new_requests:
            spec = new.sampling_params.structured_outputs
            if spec is not None and self.stage.is_last:  # only the sampling stage masks
                self.grammars.start(new.request_id, spec, new.output_token_ids)
            self.requests[new.request_id] = Request(
                request_id=new.request_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=new.sampling_params,
                eos_token_ids=self.eos_token_ids,
                seed=new.seed,
                output_token_ids=list(new.output_token_ids),
            )
            self.block_tables[new.request_id] = []

    def _run(self, plan: StepPlan) -> list[SampledToken]:
        chunks = []
        for planned in plan.chunks:
            table = self.block_tables[planned.request_id]
            table.extend(planned.new_block_ids)
            request = self.requests[planned.request_id]
            chunks.append(ScheduledChunk(request, planned.start, planned.num_new_tokens, table))
        if self.stage.enabled:
            return run_stage(self, chunks)
        batch = self.runner.prepare(chunks)
        began = self.forward_began()
        logits = self.runner.execute(batch)
        self.forward_ended(began)
        return self.take_logits(logits, batch)

    def take_logits(self, logits: torch.Tensor, batch: StepBatch) -> list[SampledToken]:
        """The batch's logits rows: its prompt spans scored (kept for the step's result),
        then its sampling requests' tokens sampled."""
        num_sampling = len(batch.sampling_requests)
        if batch.prompt_spans:
            self._score_prompts(logits[num_sampling:], batch)
        if not num_sampling:  # a step of mid-prompt chunks samples nothing
            return []
        return self.sample(logits[:num_sampling], batch.sampling_requests)

    def _score_prompts(self, logits: torch.Tensor, batch: StepBatch) -> None:
        """Raw logprobs (no mask, bias or penalty) of the prompt tokens the rows predict,
        a span at a time (a long chunk's rows × the vocabulary are already large)."""
        row = 0
        for span in batch.prompt_spans:
            num_top = span.request.sampling_params.prompt_logprobs or 0
            rows = torch.log_softmax(logits[row : row + span.count], dim=-1)
            described = describe_rows(rows, span.token_ids, num_top)
            self._prompt_logprobs.append(
                PromptLogprobs(span.request.request_id, span.first, described)
            )
            row += span.count

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """Tokens for `requests` from their logits rows; appended to their mirrors."""
        self.grammars.mask(logits, [r.request_id for r in requests])
        tokens, logprobs = self.sampler.sample(logits, requests)
        sampled = []
        for request, token, lp in zip(requests, tokens, logprobs, strict=True):
            request.output_token_ids.append(token)
            self.grammars.advance(request.request_id, token)
            sampled.append(SampledToken(request.request_id, token, lp))
        return sampled
