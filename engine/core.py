"""One instance's engine: the step scheduler driving an executor, stepped by its owner.

The owner (the offline `LLM`, or an instance's step loop) adds requests and calls
`step()`, which plans a step, runs it through the executor seam and returns the
step's token deltas. This module is torch-free: the model lives behind the executor
(`InProcessExecutor` by default), so a driver runs with a fake one and no torch.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.common.messages import GenerateTask, RequestDelta, error_delta
from pdserve.common.request import Request, RequestStatus
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.executor import ConnectorFactory, Executor, InProcessExecutor
from pdserve.engine.grammar_gate import GrammarGate
from pdserve.engine.step_plan import (
    NewRequest,
    PlannedChunk,
    PromptLogprobs,
    StepPlan,
    WorkerInfo,
)
from pdserve.scheduler.config import SchedulerConfig
from pdserve.scheduler.outputs import SchedulerOutput
from pdserve.scheduler.step_scheduler import Scheduler

if TYPE_CHECKING:
    from pdserve.engine.ranks import RankLauncher

_HANDED_OFF = RequestStatus.HANDED_OFF


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0  # every token run through the model, prompt or output
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (cache misses)
    mixed_steps: int = 0  # steps that ran prefill chunks beside decodes
    model_seconds: float = 0.0
    collective_seconds: float = 0.0  # of model_seconds: tensor-parallel collectives (rank 0)
    stage_transfer_seconds: float = 0.0  # of model_seconds: sends/receives between stages


class StepPlanner:
    """Turns the scheduler's output into the `StepPlan` the ranks need: a request in
    full the first time, afterwards only its chunk and the blocks it gained."""

    def __init__(self) -> None:
        self._blocks_sent: dict[str, int] = {}  # request id → block-table length on the ranks

    def plan(self, output: SchedulerOutput, kv_connector: Any = None) -> StepPlan:
        finished = [*output.finished_ids, *output.preempted_ids]
        for request_id in finished:
            self._blocks_sent.pop(request_id, None)
        new_requests, chunks = [], []
        for chunk in output.chunks:
            request = chunk.request
            sent = self._blocks_sent.get(request.request_id)
            if sent is None:
                sent = 0
                new_requests.append(
                    NewRequest(
                        request.request_id,
                        request.prompt_token_ids,
                        list(request.output_token_ids),
                        request.sampling_params,
                        request.seed,
                    )
                )
            chunks.append(
                PlannedChunk(
                    request.request_id, chunk.start, chunk.num_new_tokens, chunk.block_ids[sent:]
                )
            )
            self._blocks_sent[request.request_id] = len(chunk.block_ids)
        return StepPlan(finished, new_requests, chunks, kv_connector)


def default_executor(
    config: EngineConfig,
    connector: ConnectorFactory | None = None,
    on_failure: Callable[[str], None] | None = None,
    ranks: RankLauncher | None = None,
) -> Executor:
    """One rank in this process, or a worker group of `tensor_parallel_size` ×
    `pipeline_parallel_size` ranks (`on_failure`: told when the group dies between
    steps), each rank with its connector, started by `ranks` (default: child processes)."""
    if config.world_size > 1:
        from pdserve.engine.worker_group import WorkerGroupExecutor

        return WorkerGroupExecutor(config, connector, on_failure, ranks)
    return InProcessExecutor(config, connector(0, 1) if connector is not None else None)


class EngineCore:
    def __init__(
        self, config: EngineConfig | None = None, executor: Executor | None = None, **kwargs
    ) -> None:
        self.config = config or EngineConfig.from_kwargs(**kwargs)
        self.executor = executor or default_executor(self.config)
        self.info: WorkerInfo = self.executor.load()
        if self.info.kv.block_size != self.config.block_size:
            raise ValueError(
                f"the executor's KV blocks hold {self.info.kv.block_size} tokens, "
                f"not block_size {self.config.block_size}"
            )
        self._check_one_request_fits()
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                max_model_len=self.info.max_model_len,
                block_size=self.config.block_size,
                num_blocks=self.info.kv.num_blocks,
                enable_prefix_caching=self.config.enable_prefix_caching,
                enable_chunked_prefill=self.config.enable_chunked_prefill,
                scheduling_policy=self.config.scheduling_policy,
            )
        )
        self.eos_token_ids = frozenset(self.info.eos_token_ids)
        self.stats = EngineStats()
        self.planner = StepPlanner()
        self._seeds = random.Random(self.config.seed)
        self.grammar_gate = GrammarGate(
            lambda spec: self.executor.prepare_grammar(spec),
            self.config.grammar_compile_timeout_s,
        )
        self._gate_errors: list[RequestDelta] = []  # requests whose grammar failed

    def _check_one_request_fits(self) -> None:
        """Refuses a KV cache that cannot hold one request of max_model_len: such an
        engine would start, then stall or preempt forever on the first long request."""
        blocks, size = self.info.kv.num_blocks, self.config.block_size
        if blocks * size >= self.info.max_model_len:
            return
        if self.config.num_kv_blocks is not None:
            more = "num_kv_blocks"
        elif self.config.device == "cpu":
            more = "--kv-cache-memory"
        else:
            more = "--gpu-memory-utilization"
        self.executor.shutdown()  # the caller gets no engine to shut down
        raise ValueError(
            f"the KV cache holds {blocks} blocks x {size} = {blocks * size} tokens, fewer "
            f"than one request of max_model_len {self.info.max_model_len}: raise {more} "
            f"or lower --max-model-len"
        )

    @property
    def model_path(self) -> str:
        return self.info.model_path

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def kernels_status(self) -> str:
        """Which kernels this engine's attention and fused ops run on."""
        return self.info.kernels

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- requests -------------------------------------------------------------------

    def request_of(self, task: GenerateTask, received_at: float | None = None) -> Request:
        """The request a gateway's task asks for: its prompt, sampling parameters, cache
        salt and any output it already has (a migrated request's); `received_at`: when
        the instance's I/O thread decoded the task (`time.monotonic()`)."""
        return self.make_request(
            task.request_id,
            task.prompt_token_ids,
            task.sampling_params,
            task.cache_salt,
            output_token_ids=task.output_token_ids,
            received_at=received_at,
        )

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str = "",
        arrival_time: float | None = None,
        output_token_ids: list[int] | None = None,
        received_at: float | None = None,
    ) -> Request:
        """`output_token_ids`: output a migrated request already has (sampling goes on
        from the next output index, as after a preemption); `received_at`: when its task
        reached the instance (`time.monotonic()`; its timeline's queue starts there)."""
        for what, tokens in (("prompt", prompt_token_ids), ("output", output_token_ids or ())):
            bad = [t for t in tokens if not 0 <= t < self.info.vocab_size]
            if bad:
                raise ValueError(f"{what} holds token id {bad[0]} outside the vocabulary")
        seed = sampling_params.seed
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids or ()),
            sampling_params=sampling_params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            seed=self._seeds.getrandbits(63) if seed is None else seed,
            received_time=received_at,
        )

    def add_request(self, request: Request, hand_off: bool = False) -> None:
        """Schedules the request (`hand_off`: only up to its first token, see
        `Scheduler.add_request`) once its structured-output grammar, if any, compiled."""
        self.grammar_gate.admit(request, lambda: self.scheduler.add_request(request, hand_off))

    def add_remote_request(self, request: Request, num_remote_tokens: int) -> None:
        """A handed-off request whose first `num_remote_tokens` of KV are pulled from
        another instance (`Scheduler.add_remote_request`), once its grammar compiled."""
        self.grammar_gate.admit(
            request, lambda: self.scheduler.add_remote_request(request, num_remote_tokens)
        )

    def holds(self, request_id: str) -> bool:
        """Whether the request is here: scheduled, or waiting for its grammar."""
        return request_id in self.scheduler.requests or request_id in self.grammar_gate

    def request_ids(self) -> set[str]:
        """Every request here: scheduled, or waiting for its grammar."""
        return {*self.scheduler.requests, *self.grammar_gate.request_ids()}

    def abort_request(self, request_id: str) -> None:
        if not self.grammar_gate.abort(request_id):
            self.scheduler.abort_request(request_id)

    def finish_request(self, request_id: str) -> None:
        """Ends a request whose text matched a stop string (the front end decides)."""
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or len(self.grammar_gate) > 0

    # ---- stepping -------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        return self.execute(self.schedule())

    def schedule(self) -> SchedulerOutput:
        """The scheduler's next step, after admitting requests whose grammar compiled
        (those whose grammar failed come back with the step's deltas)."""
        for request, reason in self.grammar_gate.poll():
            self._gate_errors.append(
                error_delta(
                    request.request_id, reason, request.num_prompt_tokens, request.num_output_tokens
                )
            )
        return self.scheduler.schedule()

    def execute(self, output: SchedulerOutput) -> list[RequestDelta]:
        """Runs a step the scheduler planned. Owners that act on the plan itself (a
        decode instance pulls the KV of `output.remote_kv_allocations`, which a step
        can carry while computing nothing) call `scheduler.schedule()` and then this."""
        return self.execute_with_kv(output)[0]

    def execute_with_kv(
        self, output: SchedulerOutput, kv_connector: Any = None
    ) -> tuple[list[RequestDelta], list[Any]]:
        """`execute`, with the KV connector's metadata for the step going to the ranks;
        returns the deltas and each rank's KV connector report."""
        failed, self._gate_errors = self._gate_errors, []
        planned = time.perf_counter() if self.config.collect_model_time else 0.0
        plan = self.planner.plan(output, kv_connector)
        if plan.is_empty and not plan.finished_ids and kv_connector is None:
            return failed, []
        started = time.perf_counter()
        result = self.executor.execute(plan)
        if plan.is_empty:
            return failed, result.kv_reports
        ended = time.perf_counter()
        self.stats.model_seconds += ended - started
        self.stats.collective_seconds += result.collective_seconds
        self.stats.stage_transfer_seconds += result.stage_transfer_seconds
        self._count(output)
        if self.config.collect_model_time:
            self._charge_model_time(output, result.forward_seconds, ended - planned)
        sampled = {s.request_id: s.token_id for s in result.sampled}
        self.scheduler.update_from_output(output, sampled)
        requests = {c.request.request_id: c.request for c in output.chunks}
        for scored in result.prompt_logprobs:
            self._keep_prompt_logprobs(requests[scored.request_id], scored)
        deltas = [self._delta(requests[s.request_id], s) for s in result.sampled]
        return failed + deltas, result.kv_reports

    @staticmethod
    def _charge_model_time(output: SchedulerOutput, forward: float | None, execute: float) -> None:
        """Each request of the step is charged the whole step (vLLM's way), before the
        scheduler's update stamps its tokens: its execute time stays inside the span
        those stamps bound."""
        for chunk in output.chunks:
            request = chunk.request
            request.add_model_time(request.prefills_here, forward, execute)

    def exchange_kv(self, kv_connector: Any) -> list[Any]:
        """Hands the ranks' KV connectors their metadata without a model step; returns
        their reports (e.g. a prefill instance's holds, before its handoff leaves)."""
        return self.executor.execute(StepPlan(kv_connector=kv_connector)).kv_reports

    @staticmethod
    def _keep_prompt_logprobs(request: Request, scored: PromptLogprobs) -> None:
        """Into the request's list of prompt tokens 1..n-1, by position."""
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * (request.num_prompt_tokens - 1)
        start = scored.first - 1
        request.prompt_logprobs[start : start + len(scored.logprobs)] = scored.logprobs

    @staticmethod
    def _delta(request: Request, sampled) -> RequestDelta:
        status = request.status
        prompt_logprobs = None
        output_index = request.num_output_tokens - 1
        if output_index == 0 and request.sampling_params.prompt_logprobs is not None:
            # Once, with the first token: a one-token prompt has none to score.
            prompt_logprobs = request.prompt_logprobs or []
            request.prompt_logprobs = None
        return RequestDelta(
            request_id=request.request_id,
            new_token_ids=[sampled.token_id],
            output_index=output_index,
            logprobs=None if sampled.logprobs is None else [sampled.logprobs],
            prompt_logprobs=prompt_logprobs,
            finish_reason=status.finish_reason if status.finished else None,
            stop_reason=request.stop_reason if status.finished else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            # Once, as the request leaves this instance (finished, or handed off).
            timings=request.timings() if status.finished or status is _HANDED_OFF else None,
        )

    def _count(self, output: SchedulerOutput) -> None:
        self.stats.steps += 1
        self.stats.tokens_computed += output.num_tokens
        self.stats.prompt_tokens_computed += sum(
            max(0, min(c.end, c.request.num_prompt_tokens) - c.start) for c in output.chunks
        )
        decodes = sum(1 for c in output.chunks if c.num_new_tokens == 1)
        if decodes and len(output.chunks) > decodes:
            self.stats.mixed_steps += 1
