"""One API request on the cluster: its choices submitted, their text streamed back.

A request is a list of prompts times `n` choices; each choice is one engine request.
Token deltas (already in order) are detokenized incrementally per choice with stop
strings applied (`TextStream`): a stop-string match ends the choice here with
finish_reason "stop" and aborts it on its instances. The gateway's latency histograms
are observed here, labelled by the instance that produced each token.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from pdserve.gateway.dispatcher import Dispatcher
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.prompts import Prompt
from pdserve.gateway.request_stream import StreamEvent
from pdserve.scheduler.messages import GenerateTask, TokenLogprobs
from pdserve.scheduler.sampling_params import SamplingParams
from pdserve.text.detokenizer import TextStream
from pdserve.text.tokenizer import Tokenizer

_SEEDS = random.SystemRandom()


class GenerationFailed(Exception):
    """A choice ended in an error. `rejected`: the instance refused it before any token
    (a request this deployment cannot serve); otherwise an instance failed."""

    def __init__(self, message: str, rejected: bool) -> None:
        super().__init__(message)
        self.rejected = rejected


@dataclass
class Choice:
    index: int
    prompt_index: int
    request_id: str
    stream: TextStream
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    last_token_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    ) -> None:
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.cache_salt = cache_salt
        self.arrival = time.perf_counter()
        self.choices: list[Choice] = []
        self._by_request: dict[str, Choice] = {}
        self._events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._unfinished = 0

    # ---- submitting -------------------------------------------------------------------

    def start(self) -> None:
        """Admits and sends every choice, all or none (raises AdmissionRejected)."""
        n = self.params.n
        self.dispatcher.scheduler.admit(len(self.prompts) * n)
        base_seed = self.params.seed
        try:
            for prompt_index, prompt in enumerate(self.prompts):
                for j in range(n):
                    seed = base_seed + j if base_seed is not None else _SEEDS.getrandbits(63)
                    self._submit(prompt_index, prompt, prompt_index * n + j, seed)
        except BaseException:
            self.abort()
            raise

    def _submit(self, prompt_index: int, prompt: Prompt, index: int, seed: int) -> None:
        params = self.params
        child = msgspec.structs.replace(params, n=1, seed=seed)
        request_id = f"{self.request_id}-{index}"
        choice = Choice(
            index=index,
            prompt_index=prompt_index,
            request_id=request_id,
            stream=TextStream(
                self.tokenizer,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            ),
            num_prompt_tokens=len(prompt.token_ids),
            logprobs=[] if params.logprobs is not None else None,
        )
        task = GenerateTask(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling_params=child,
            seed=seed,
            arrival_time=time.time(),
            cache_salt=self.cache_salt,
        )
        self.choices.append(choice)
        self._by_request[request_id] = choice
        self._unfinished += 1
        self.dispatcher.submit(task, self._events.put_nowait)

    def abort(self) -> None:
        """Aborts every unfinished choice (client gone, or a failure); idempotent."""
        ids = [c.request_id for c in self.choices if not c.finished]
        for choice in self.choices:
            if not choice.finished:
                choice.finish_reason = "abort"
        self._unfinished = 0
        if ids:
            self.dispatcher.abort(ids)

    @property
    def finished(self) -> bool:
        return self._unfinished == 0

    # ---- receiving --------------------------------------------------------------------

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Choice updates in arrival order until every choice has finished."""
        while self._unfinished:
            event = await self._events.get()
            update = self._absorb(event)
            if update is not None:
                yield update

    async def wait(self) -> list[Choice]:
        async for _ in self.updates():
            pass
        return self.choices

    def _absorb(self, event: StreamEvent) -> ChoiceUpdate | None:
        choice = self._by_request.get(event.request_id)
        if choice is None or choice.finished:
            return None
        if event.error is not None:
            self._end(choice, "error")
            choice.error = event.error
            self.abort()
            raise GenerationFailed(event.error, rejected=False)
        delta = event.delta
        assert delta is not None
        if delta.finish_reason == "error":
            self._end(choice, "error")
            choice.error = delta.error or "the instance failed the request"
            self.abort()
            raise GenerationFailed(choice.error, rejected=not choice.token_ids)
        self._observe_timing(choice, event, len(delta.new_token_ids))
        choice.token_ids.extend(delta.new_token_ids)
        choice.num_cached_tokens = delta.num_cached_tokens
        logprobs = list(delta.logprobs or [])
        if choice.logprobs is not None:
            choice.logprobs.extend(logprobs)
        released = choice.stream.add_tokens(delta.new_token_ids)
        text, finish = released.text, None
        if released.stopped:
            finish, choice.stop_reason = "stop", released.stop_string
            self.dispatcher.abort([choice.request_id])
        elif delta.finished:
            tail = choice.stream.finish()  # held-back text, which may complete a stop string
            text += tail.text
            if tail.stopped:
                finish, choice.stop_reason = "stop", tail.stop_string
            else:
                finish, choice.stop_reason = delta.finish_reason, delta.stop_reason
        if finish is not None:
            self._end(choice, finish)
            self._observe_end(event)
        return ChoiceUpdate(choice, text, list(delta.new_token_ids), logprobs, finish)

    def _end(self, choice: Choice, reason: str) -> None:
        choice.finish_reason = reason
        self._unfinished -= 1

    def _observe_timing(self, choice: Choice, event: StreamEvent, num_tokens: int) -> None:
        if not num_tokens:
            return
        role = self.dispatcher.role_of(event.source)
        if choice.last_token_at is None:
            ttft = event.arrival - self.arrival
            self.metrics.observe("time_to_first_token_seconds", role, event.source, ttft)
        else:
            gap = event.arrival - choice.last_token_at
            self.metrics.observe("inter_token_latency_seconds", role, event.source, gap)
        choice.last_token_at = event.arrival

    def _observe_end(self, event: StreamEvent) -> None:
        role = self.dispatcher.role_of(event.source)
        self.metrics.observe(
            "e2e_request_latency_seconds", role, event.source, event.arrival - self.arrival
        )
        self.metrics.count("request_success_total", role, event.source)

    # ---- totals -----------------------------------------------------------------------

    def usage(self) -> dict[str, int]:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
