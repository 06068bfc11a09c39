"""The request lifecycle as one instance's schedulers see it.

WAITING ──schedule──▶ RUNNING ──stop──▶ FINISHED_*
   ▲                    │
   └──── PREEMPTED ◀────┘ (blocks ran out: freed, recomputed later)

WAITING_FOR_REMOTE_KVS: a decode instance allocated blocks for a handed-off
request and is pulling its KV from the prefill instance; it joins RUNNING once
the blocks have arrived.

HANDED_OFF: a prefill instance sampled the first token of a request that continues on a
decode instance; it is no longer computed here, but its blocks stay held until the
decode side has pulled them (`Scheduler.release_held_blocks`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.common.messages import InstanceTimings, KVPullTimes, ModelTime, TokenLogprobs
from pdserve.common.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # Prefill side: done here after its first token, blocks held for the decode side.
    # Not a finished status: the request goes on elsewhere and has no finish reason.
    HANDED_OFF = "handed_off"
    FINISHED_STOPPED = "finished_stopped"  # eos, a stop token id, or a stop string
    FINISHED_LENGTH_CAPPED = "finished_length_capped"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"  # the client went away or asked to abort
    FINISHED_ERROR = "finished_error"  # e.g. a KV transfer failed under the `fail` policy

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` for a finished status."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds one request spent in each phase on one instance; None: not here."""

    queue: float | None = None
    prefill: float | None = None
    decode: float | None = None


@dataclass
class Request:
    """One sequence being generated. `n > 1` is expanded into n requests upstream."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    # Salts the prefix-cache hashes so tenants never share blocks.
    cache_salt: str = ""
    # Sampling randomness is keyed on (seed, output index); an unseeded request gets
    # a seed drawn at arrival so that prefill and decode instances agree on it.
    seed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in this instance's cache (computed or found in the prefix cache).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at the last admission.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    # Its task (or handoff) decoded by this instance's I/O thread, before the step loop
    # admitted it: where its queue starts on a timeline (None: not received as a task).
    received_time: float | None = None
    # When things happened to it on this instance (the scheduler's monotonic clock), for
    # vLLM's queue / prefill / decode histograms (`phase_times`).
    queued_time: float | None = None  # entered this instance's waiting queue
    first_scheduled_time: float | None = None  # first given a chunk (or its remote blocks)
    first_token_time: float | None = None  # first token sampled here
    last_token_time: float | None = None  # latest token sampled here
    kv_ready_time: float | None = None  # decode side: its pulled KV usable here
    kv_pull: KVPullTimes | None = None  # decode side: the pull as the ranks timed it
    # Each preemption here: when it lost its blocks, and when it was scheduled again.
    preempted_times: list[float] = field(default_factory=list)
    resumed_times: list[float] = field(default_factory=list)
    # Decode side: its prompt was computed on a prefill instance (a handoff).
    prefilled_elsewhere: bool = False
    # The driver's copy of prompt tokens 1..n-1's logprobs as the ranks compute them
    # (by position: a prompt recomputed after a preemption overwrites the same entries).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With model detail on: the model time of its steps here before its first token, and
    # of each decode stretch after it (`add_model_time`).
    prefill_model: ModelTime | None = None
    decode_model: list[ModelTime] = field(default_factory=list)

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Whether computing its prompt must also score it: asked for, and not yet
        delivered (no output yet: a handoff, a migration or a preemption after the first
        token already has them where they go)."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def phase_times(self, handed_off: bool = False) -> PhaseTimes:
        """vLLM's phases of a request that leaves this instance: queue = queued until
        first scheduled, prefill = first scheduled until the first token, decode = first
        token until the last. A prefill instance that hands it off has no decode part;
        a decode instance has only decode, measured from its arrival here (the handoff
        leaves the prefill instance with the first token: the gap is its transit)."""
        if self.prefilled_elsewhere:
            if self.queued_time is None or self.last_token_time is None:
                return PhaseTimes()
            return PhaseTimes(decode=self.last_token_time - self.queued_time)
        if self.queued_time is None or self.first_scheduled_time is None:
            return PhaseTimes()  # never ran here
        queue = self.first_scheduled_time - self.queued_time
        if self.first_token_time is None:
            return PhaseTimes(queue=queue)
        prefill = self.first_token_time - self.first_scheduled_time
        if handed_off or self.last_token_time is None:
            return PhaseTimes(queue=queue, prefill=prefill)
        return PhaseTimes(queue, prefill, self.last_token_time - self.first_token_time)

    @property
    def prefills_here(self) -> bool:
        """Whether a step it is in now computes toward its first token on this instance."""
        return self.first_token_time is None and not self.prefilled_elsewhere

    def add_model_time(self, prefilling: bool, forward: float | None, execute: float) -> None:
        """Counts one step it was part of (`prefilling`: its `prefills_here` when the step
        was planned) toward its prefill, or toward the decode stretch it is in: one per
        preemption since its first token here, as the gateway splits its decode span."""
        if prefilling:
            if self.prefill_model is None:
                self.prefill_model = ModelTime()
            _charge(self.prefill_model, forward, execute)
            return
        stretch = 0
        if self.preempted_times:  # rare: most requests are never preempted
            since = self.first_token_time if not self.prefilled_elsewhere else None
            stretch = sum(1 for lost in self.preempted_times if since is None or lost >= since)
        while len(self.decode_model) <= stretch:
            self.decode_model.append(ModelTime())
        _charge(self.decode_model[stretch], forward, execute)

    def timings(self) -> InstanceTimings | None:
        """Its phases here on this process's wall clock (the scheduler stamps them on the
        monotonic clock, which other processes cannot compare); None if never queued."""
        if self.queued_time is None:
            return None
        offset = time.time() - time.monotonic()
        queued = self.queued_time if self.received_time is None else self.received_time

        def wall(stamp: float | None) -> float | None:
            return None if stamp is None else stamp + offset

        return InstanceTimings(
            queued=queued + offset,
            first_scheduled=wall(self.first_scheduled_time),
            kv_ready=wall(self.kv_ready_time),
            first_token=wall(self.first_token_time),
            last_token=wall(self.last_token_time),
            kv_pull=self.kv_pull,
            preemptions=[
                (p + offset, r + offset)
                for p, r in zip(self.preempted_times, self.resumed_times, strict=False)
            ],
            prefill_model=self.prefill_model,
            decode_model=self.decode_model,
        )

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens_between(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]


def _charge(total: ModelTime, forward: float | None, execute: float) -> None:
    """Adds one step's figures; a forward not timed leaves the total's untimed too."""
    total.forward = None if forward is None or total.forward is None else total.forward + forward
    total.execute += execute
