"""The gateway's book of request timelines: live records, the recent ones kept, each run's
phases observed in `pdserve:request_phase_seconds` and handed to the trace exporter.

`GET /admin/requests/{id}/timeline` reads the store: the latest `capacity` runs, by the
response id a client sees (`cmpl-...`, `chatcmpl-...`) or a choice's id (`...-0`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from pdserve.common.messages import InstanceTimings
from pdserve.gateway.clock_sync import ClockSync
from pdserve.gateway.global_scheduler import Route
from pdserve.gateway.timeline import (
    Attempt,
    ChoiceRecord,
    Phase,
    PhaseBuilder,
    Stint,
    model_totals,
)

STORE_CAPACITY = 1000  # runs kept for the endpoint, newest first out last

Move = tuple[str, str, int]  # a request sent again: (kind, reason, tokens carried)

# The response id's prefix -> the GenAI semantic conventions' gen_ai.operation.name.
OPERATIONS = {"cmpl": "text_completion", "chatcmpl": "chat", "resp": "chat"}


class ChoiceTimeline(msgspec.Struct):
    request_id: str
    e2e_s: float  # the gateway's arrival of the request → this choice's text out
    clock_error_s: float  # the widest clock uncertainty among its instances
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    phases: list[Phase]
    # Its compute spans' model seconds summed (`timeline.model_totals`; {} without
    # model detail).
    model: dict[str, str | int | float] = {}


class RunTimeline(msgspec.Struct):
    """One API request: its choices' timelines (what the endpoint answers)."""

    id: str
    operation: str
    model: str
    received: float  # gateway wall clock, seconds
    end: float
    choices: list[ChoiceTimeline]
    traceparent: str = ""  # the client's, when it sent one


@dataclass(frozen=True)
class TraceHeaders:
    """The client's W3C trace context (`traceparent`, `tracestate` headers)."""

    traceparent: str = ""
    tracestate: str = ""


@dataclass(frozen=True)
class RunFacts:
    """What the run knows that its timeline and trace name (`GenerationRun`'s)."""

    run_id: str
    choice_ids: list[str]
    params: dict[str, float | int]  # gen_ai.request.* the request set, gen_ai.usage.*
    trace: TraceHeaders = TraceHeaders()


class RunExporter(Protocol):
    """Where a finished run's timeline goes besides the store (`gateway/tracing.py`)."""

    def export(self, run: RunTimeline, facts: RunFacts) -> None: ...

    def shutdown(self) -> None: ...


class Timelines:
    """Every live choice's record, the latest runs' timelines, the instances' clocks."""

    def __init__(
        self,
        model: str = "",
        observe: Callable[[str, float], None] | None = None,
        capacity: int = STORE_CAPACITY,
    ) -> None:
        """`observe(phase, seconds)`: the phase histogram."""
        self.model = model
        self.clocks = ClockSync()
        self.exporter: RunExporter | None = None
        self._observe = observe
        self._live: dict[str, ChoiceRecord] = {}
        self._runs: OrderedDict[str, RunTimeline] = OrderedDict()
        self._choice_runs: dict[str, str] = {}
        self._capacity = capacity

    # ---- recording (the event loop) ---------------------------------------------------

    def open(self, request_id: str, received: float, num_prompt_tokens: int) -> None:
        self._live[request_id] = ChoiceRecord(
            request_id, received, num_prompt_tokens=num_prompt_tokens
        )

    def dispatched(self, request_id: str, route: Route, move: Move | None = None) -> None:
        """Sent on `route` (stamped before the send: it bounds the instance's clock);
        `move`: (kind, reason, tokens carried) when it is sent again."""
        record = self._live.get(request_id)
        if record is None:
            return
        now = time.time()
        first = Stint(route.first.instance_id, route.first.role)
        second = Stint(route.decode.instance_id, route.decode.role) if route.prefill else None
        attempt = Attempt(now, first, second)
        if move is not None:
            attempt.move, attempt.reason, attempt.tokens_carried = move
            attempt.moved_at = now
        record.attempts.append(attempt)

    def observe_output(self, instance_id: str, sent_at: float) -> float:
        """An instance's output came in: its clock's upper bound. Returns the receipt
        on the gateway's wall clock, which timelines are on."""
        received = time.time()
        self.clocks.observe_output(instance_id, sent_at, received)
        return received

    def delta(
        self, request_id: str, instance_id: str, arrival: float, timings: InstanceTimings | None
    ) -> None:
        record = self._live.get(request_id)
        if record is not None:
            record.observe_delta(instance_id, arrival, timings)

    def choice_ended(self, request_id: str, finish_reason: str, output_tokens: int) -> None:
        record = self._live.get(request_id)
        if record is not None and record.end is None:
            record.end = time.time()
            record.finish_reason = finish_reason
            record.num_output_tokens = output_tokens

    # ---- a run's end ------------------------------------------------------------------

    def finish_run(self, facts: RunFacts) -> RunTimeline | None:
        """Builds, keeps, observes and exports the run's timeline; its records go."""
        records = [r for r in (self._live.pop(i, None) for i in facts.choice_ids) if r]
        if not records:
            return None
        now = time.time()
        choices = [self._choice(record, now) for record in records]
        prefix = facts.run_id.split("-", 1)[0]
        run = RunTimeline(
            id=facts.run_id,
            operation=OPERATIONS.get(prefix, prefix),
            model=self.model,
            received=min(r.received for r in records),
            end=max(r.end or now for r in records),
            choices=choices,
            traceparent=facts.trace.traceparent,
        )
        self._keep(run)
        if self._observe is not None:
            for choice in choices:
                for phase in choice.phases:
                    self._observe(phase.name, max(0.0, phase.seconds))
                    for child in phase.children:
                        self._observe(child.name, max(0.0, child.seconds))
        if self.exporter is not None:
            self.exporter.export(run, facts)
        return run

    def _choice(self, record: ChoiceRecord, now: float) -> ChoiceTimeline:
        if record.end is None:
            record.end = now
            record.finish_reason = record.finish_reason or "abort"
        builder = PhaseBuilder(record, self.clocks)
        phases = builder.build()
        return ChoiceTimeline(
            request_id=record.request_id,
            e2e_s=record.end - record.received,
            clock_error_s=builder.clock_error_s,
            finish_reason=record.finish_reason,
            prompt_tokens=record.num_prompt_tokens,
            output_tokens=record.num_output_tokens,
            phases=phases,
            model=model_totals(phases),
        )

    # ---- the store --------------------------------------------------------------------

    def _keep(self, run: RunTimeline) -> None:
        self._runs[run.id] = run
        for choice in run.choices:
            self._choice_runs[choice.request_id] = run.id
        while len(self._runs) > self._capacity:
            _, old = self._runs.popitem(last=False)
            for choice in old.choices:
                self._choice_runs.pop(choice.request_id, None)

    def get(self, request_id: str) -> RunTimeline | None:
        """A recent run by its id or one of its choices' ids."""
        run = self._runs.get(request_id)
        if run is None and request_id in self._choice_runs:
            run = self._runs.get(self._choice_runs[request_id])
        return run

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.shutdown()

    def forget_instance(self, instance_id: str) -> None:
        """A lost instance's clock goes with it (a replacement may run on another)."""
        self.clocks.forget(instance_id)
