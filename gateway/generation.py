"""One API request on the cluster: its choices submitted, their text streamed back.

A request is a list of prompts times `n` choices; each choice is one engine request.
Token deltas (already in order) are detokenized incrementally per choice with stop
strings applied (`ChoiceText`): a stop-string match ends the choice here with
finish_reason "stop" and aborts it on its instances. The gateway's latency histograms
are observed here, labelled by the instance that produced each token.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import NoReturn

import msgspec

from pdserve.common.messages import GenerateTask, TokenLogprobs
from pdserve.common.sampling_params import SamplingParams
from pdserve.gateway.dispatcher import Dispatcher
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.prompts import Prompt
from pdserve.gateway.request_stream import StreamEvent
from pdserve.gateway.slo_samples import SloSamples
from pdserve.gateway.timelines import RunFacts, TraceHeaders
from pdserve.text.choice import ChoiceText, choice_seeds
from pdserve.text.tokenizer import Tokenizer

_SEEDS = random.SystemRandom()


class GenerationFailed(Exception):
    """A choice ended in an error. `rejected`: the instance refused it before any token
    (a request this deployment cannot serve); `timed_out`: the request outlived
    `--request-timeout`; otherwise an instance failed."""

    def __init__(self, message: str, rejected: bool, timed_out: bool = False) -> None:
        super().__init__(message)
        self.rejected = rejected
        self.timed_out = timed_out


@dataclass(kw_only=True)
class Choice(ChoiceText):
    index: int
    prompt_index: int
    request_id: str
    num_prompt_tokens: int
    error: str | None = None
    last_token_at: float | None = None
    source: str = ""  # the instance its last output came from


@dataclass
class ChoiceUpdate:
    """New displayable text of one choice (and the tokens and logprobs behind it)."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None


class GenerationRun:
    def __init__(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        dispatcher: Dispatcher,
        tokenizer: Tokenizer,
        metrics: GatewayMetrics,
        cache_salt: str = "",
        on_end: Callable[[dict[str, int]], None] | None = None,
        timeout_s: float = 0.0,
        received: float | None = None,
        trace: TraceHeaders = TraceHeaders(),
        samples: SloSamples | None = None,
    ) -> None:
        """`on_end`: called once with the usage when the last choice ends or the run is
        aborted (the tenant's seat and unused tokens go back). `timeout_s`: the server-side
        deadline from arrival to the last token (0: none); past it every choice is aborted
        on its instances and the run fails. `received`: when the HTTP request came in (wall
        clock; default: now), where its timeline starts; `trace`: the client's context;
        `samples`: where its TTFTs and inter-token gaps go for the SLO controller."""
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.cache_salt = cache_salt
        self.timeout_s = timeout_s
        self.arrival = time.perf_counter()
        self.received = time.time() if received is None else received
        self.trace = trace
        self.samples = samples
        self.timelines = dispatcher.timelines
        self.choices: list[Choice] = []
        self._by_request: dict[str, Choice] = {}
        self._events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._unfinished = 0
        self._on_end = on_end
        self._ended = False

    # ---- submitting -------------------------------------------------------------------

    def start(self) -> None:
        """Admits and sends every choice, all or none (raises AdmissionRejected)."""
        n = self.params.n
        self.dispatcher.scheduler.admit(len(self.prompts) * n)
        try:
            for prompt_index, prompt in enumerate(self.prompts):
                # Every seed is resolved here, so P and D of a choice sample the same stream.
                for j, seed in enumerate(choice_seeds(self.params.seed, n, _SEEDS)):
                    self._submit(prompt_index, prompt, prompt_index * n + j, seed)
        except BaseException:
            self.abort()
            raise

    def _submit(self, prompt_index: int, prompt: Prompt, index: int, seed: int) -> None:
        child = msgspec.structs.replace(self.params, n=1, seed=seed)
        request_id = f"{self.request_id}-{index}"
        choice = Choice.for_params(
            self.tokenizer,
            self.params,
            index=index,
            prompt_index=prompt_index,
            request_id=request_id,
            num_prompt_tokens=len(prompt.token_ids),
        )
        task = GenerateTask(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling_params=child,
            arrival_time=time.time(),
            cache_salt=self.cache_salt,
        )
        self.choices.append(choice)
        self._by_request[request_id] = choice
        self._unfinished += 1
        self.timelines.open(request_id, self.received, len(prompt.token_ids))
        self.dispatcher.submit(task, self._events.put_nowait)

    def abort(self) -> None:
        """Aborts every unfinished choice (client gone, or a failure); idempotent."""
        ids = [c.request_id for c in self.choices if not c.finished]
        for choice in self.choices:
            if not choice.finished:
                choice.finish_reason = "abort"
                # vLLM counts aborted requests among its finished ones, by reason.
                role = self.dispatcher.role_of(choice.source) if choice.source else ""
                self.metrics.vllm.count_success(role, choice.source, "abort")
        self._unfinished = 0
        if ids:
            self.dispatcher.abort(ids)
        self._end()

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self._on_end is not None:
            self._on_end(self.usage())
        self.timelines.finish_run(self._facts())

    def _facts(self) -> RunFacts:
        p = self.params
        wanted = {
            "gen_ai.request.max_tokens": p.max_tokens,
            "gen_ai.request.temperature": p.temperature,
            "gen_ai.request.top_p": p.top_p,
            "gen_ai.request.choice.count": p.n,
        }
        params = {k: v for k, v in wanted.items() if v is not None}
        usage = self.usage()
        params["gen_ai.usage.input_tokens"] = usage["prompt_tokens"]
        params["gen_ai.usage.output_tokens"] = usage["completion_tokens"]
        ids = [c.request_id for c in self.choices]
        return RunFacts(self.request_id, ids, params, self.trace)

    @property
    def finished(self) -> bool:
        return self._unfinished == 0

    # ---- receiving --------------------------------------------------------------------

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Choice updates in arrival order until every choice has finished."""
        while self._unfinished:
            event = await self._next_event()
            update = self._absorb(event)
            if update is not None:
                yield update

    async def _next_event(self) -> StreamEvent:
        if not self.timeout_s:
            return await self._events.get()
        remaining = self.arrival + self.timeout_s - time.perf_counter()
        try:
            return await asyncio.wait_for(self._events.get(), max(0.0, remaining))
        except TimeoutError:
            for choice in self.choices:
                if not choice.finished:
                    choice.error = f"timed out after {self.timeout_s:g} s"
            self.abort()  # every choice, on every instance it is on
            message = f"the request did not finish within --request-timeout ({self.timeout_s:g} s)"
            raise GenerationFailed(message, rejected=False, timed_out=True) from None

    async def wait(self) -> list[Choice]:
        async for _ in self.updates():
            pass
        return self.choices

    def _absorb(self, event: StreamEvent) -> ChoiceUpdate | None:
        choice = self._by_request.get(event.request_id)
        if choice is None or choice.finished:
            return None
        if event.error is not None:
            self._fail(choice, event.error, rejected=False)
        delta = event.delta
        assert delta is not None
        if delta.finish_reason == "error":
            message = delta.error or "the instance failed the request"
            self._fail(choice, message, rejected=not choice.token_ids)
        choice.source = event.source
        self._observe_timing(choice, event, len(delta.new_token_ids))
        absorbed = choice.absorb(delta)
        if absorbed.end_request:
            self.dispatcher.abort([choice.request_id])
        if absorbed.finish_reason is not None:
            self.timelines.choice_ended(
                choice.request_id, absorbed.finish_reason, len(choice.token_ids)
            )
            self._unfinished -= 1
            self._observe_end(choice, event, absorbed.finish_reason)
            if not self._unfinished:
                self._end()
        logprobs = list(delta.logprobs or [])
        return ChoiceUpdate(
            choice, absorbed.text, list(delta.new_token_ids), logprobs, absorbed.finish_reason
        )

    def _fail(self, choice: Choice, message: str, rejected: bool) -> NoReturn:
        """Ends the choice in an error, and the whole run with it."""
        choice.finish_reason, choice.error = "error", message
        self.timelines.choice_ended(choice.request_id, "error", len(choice.token_ids))
        self.abort()  # the other choices go too
        raise GenerationFailed(message, rejected)

    def _observe_timing(self, choice: Choice, event: StreamEvent, num_tokens: int) -> None:
        if not num_tokens:
            return
        role = self.dispatcher.role_of(event.source)
        if choice.last_token_at is None:
            ttft = event.arrival - self.arrival
            self.metrics.observe("time_to_first_token_seconds", role, event.source, ttft)
            if self.samples is not None:
                self.samples.add_ttft(ttft)
        else:
            gap = event.arrival - choice.last_token_at
            self.metrics.observe("inter_token_latency_seconds", role, event.source, gap)
            if self.samples is not None:
                self.samples.add_gap(gap)
        choice.last_token_at = event.arrival

    def _observe_end(self, choice: Choice, event: StreamEvent, finish_reason: str) -> None:
        """E2E and success are counted here, not on instances: a stop string ends a
        choice here, and the instance then only sees an abort."""
        role = self.dispatcher.role_of(event.source)
        self.metrics.observe(
            "e2e_request_latency_seconds", role, event.source, event.arrival - self.arrival
        )
        self.metrics.count_success(role, event.source, finish_reason)
        self.metrics.observe_lengths(
            role, event.source, choice.num_prompt_tokens, len(choice.token_ids)
        )

    # ---- totals -----------------------------------------------------------------------

    def usage(self) -> dict[str, int]:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
