"""One choice's journey as the gateway records it, and its phases on the gateway's clock.

The gateway records what it sees itself (arrival, each dispatch, each move to another
instance, each instance's first and last delta, the end); each instance reports when
its phases happened there (`InstanceTimings`, with its last delta). `PhaseBuilder` places the
instances' timings on the gateway's clock (`ClockSync`) and cuts the journey into
phases, each timed where its work ran:

- `admission` (gateway): arrival → the task sent;
- `queue`, `prefill` (the instance that computes the prompt): queued → first
  scheduled → first token;
- `handoff` (prefill → decode): the prefill instance's first token → the pulled KV
  usable on the decode instance; its children the wait for a decode seat (arrived →
  blocks allocated) and the KV transfer as the decode ranks timed it;
- `decode` (the decode or colocated instance): KV usable (or first token) → last token,
  in stretches split by `preempted` (its blocks lost → scheduled again);
- `migration` / `retry` (gateway): the last word of a lost attempt (or its dispatch,
  when none came) → the next attempt queued on its instance;
- `detokenize` (gateway): the last delta received → its text out.

With model detail (`--collect-detailed-traces model`), `prefill` carries the prefill
instance's model seconds for the request and each `decode` stretch the decode
instance's for that stretch (vLLM's `gen_ai.latency.time_in_model_forward` and
`gen_ai.latency.time_in_model_execute`; `model_totals` sums them for the root span).

An attempt whose instance never reported (it died, or the gateway ended the request,
e.g. on a stop string) keeps the phases the gateway saw, from its deltas' arrivals,
marked `pdserve.timing.source = gateway`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pdserve.common.messages import InstanceTimings, ModelTime
from pdserve.gateway.clock_sync import ClockSync

Attributes = dict[str, str | int | float]
# Every phase name a timeline may hold (children included), for /metrics' labels.
PHASES = (
    "admission",
    "queue",
    "prefill",
    "handoff",
    "kv_seat_wait",
    "kv_transfer",
    "decode",
    "preempted",
    "migration",
    "retry",
    "detokenize",
)


FORWARD = "gen_ai.latency.time_in_model_forward"
EXECUTE = "gen_ai.latency.time_in_model_execute"


def model_attributes(spent: ModelTime | None) -> Attributes:
    """A compute span's model seconds (forward left out where it was not timed)."""
    if spent is None:
        return {}
    attributes: Attributes = {EXECUTE: spent.execute}
    if spent.forward is not None:
        attributes[FORWARD] = spent.forward
    return attributes


class Phase(msgspec.Struct):
    """A span of the timeline (gateway wall clock, seconds)."""

    name: str
    start: float
    end: float
    instance: str = ""  # where its work ran ("": the gateway)
    attributes: Attributes = {}
    children: list[Phase] = []

    @property
    def seconds(self) -> float:
        return self.end - self.start


def model_totals(phases: list[Phase]) -> Attributes:
    """The model seconds of a choice's compute spans, summed (forward only where every
    span that has an execute figure has a forward one)."""
    timed = [p.attributes for p in phases if EXECUTE in p.attributes]
    if not timed:
        return {}
    totals: Attributes = {EXECUTE: sum(float(a[EXECUTE]) for a in timed)}
    if all(FORWARD in a for a in timed):
        totals[FORWARD] = sum(float(a[FORWARD]) for a in timed)
    return totals


@dataclass
class Stint:
    """One attempt's stay on one instance."""

    instance_id: str
    role: str
    timings: InstanceTimings | None = None
    first_arrival: float | None = None  # of its deltas at the gateway
    last_arrival: float | None = None


@dataclass
class Attempt:
    """One dispatch of the choice: a route, and why it was sent again (if it was)."""

    dispatched: float
    first: Stint  # the instance the task went to
    second: Stint | None = None  # the decode instance after a prefill one
    move: str = ""  # "" (the first attempt), migration or retry
    moved_at: float = 0.0
    reason: str = ""
    tokens_carried: int = 0

    def stint(self, instance_id: str) -> Stint | None:
        for stint in (self.first, self.second):
            if stint is not None and stint.instance_id == instance_id:
                return stint
        return None


@dataclass
class ChoiceRecord:
    """Everything the gateway knows of one choice's journey."""

    request_id: str
    received: float
    attempts: list[Attempt] = field(default_factory=list)
    last_arrival: float | None = None
    end: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str = ""

    def observe_delta(
        self, instance_id: str, arrival: float, timings: InstanceTimings | None
    ) -> None:
        if not self.attempts:
            return
        stint = self.attempts[-1].stint(instance_id)
        if stint is None:
            return
        if stint.first_arrival is None:
            stint.first_arrival = arrival
        stint.last_arrival = arrival
        self.last_arrival = arrival
        if timings is not None:
            stint.timings = timings


class PhaseBuilder:
    """Cuts one finished `ChoiceRecord` into phases on the gateway's clock."""

    def __init__(self, record: ChoiceRecord, clocks: ClockSync) -> None:
        self.record = record
        self.clocks = clocks
        self.phases: list[Phase] = []
        self.clock_error_s = 0.0

    def build(self) -> list[Phase]:
        record = self.record
        first = record.attempts[0] if record.attempts else None
        self._add("admission", record.received, first.dispatched if first else record.end)
        previous_end: float | None = None
        for attempt in record.attempts:
            if attempt.move:
                self._move(attempt, previous_end)
            # An attempt lost before any word from it: the retry spans all of it.
            previous_end = self._attempt(attempt) or attempt.dispatched
        if record.last_arrival is not None and record.end is not None:
            self._add("detokenize", record.last_arrival, record.end)
        return self.phases

    # ---- one attempt ------------------------------------------------------------------

    def _attempt(self, attempt: Attempt) -> float | None:
        """Its phases; returns when its last one ended."""
        first, second = attempt.first, attempt.second
        self._learn_after(first, attempt.dispatched)
        if second is None:
            return self._alone(first)
        p = self._placed(first)
        if p is None or p.first_token is None:
            return self._seen(first, "prefill")
        self._queue_and_prefill(first, p)
        self._learn_after(second, p.first_token)
        d = self._placed(second)
        if d is None or d.kv_ready is None or d.last_token is None:
            return self._seen(second, "decode", since=p.first_token)
        self._handoff(second, p.first_token, d)
        return self._decode(second, d, d.kv_ready, d.last_token)

    def _alone(self, stint: Stint) -> float | None:
        """An instance that computes prompt and output: colocated, or a migration's."""
        t = self._placed(stint)
        if t is None or t.first_token is None or t.last_token is None:
            return self._seen(stint, "decode")
        self._queue_and_prefill(stint, t)
        return self._decode(stint, t, t.first_token, t.last_token)

    def _decode(self, stint: Stint, t: InstanceTimings, start: float, end: float) -> float:
        """Decode stretches, split where it was preempted (`preempted`: blocks lost →
        scheduled again; the recompute is the next stretch's), each with its model time."""
        stretch = 0
        for lost, resumed in t.preemptions:
            if start <= lost <= end:
                self._add("decode", start, lost, stint, self._stretch_model(t, stretch))
                self._add("preempted", lost, min(resumed, end), stint)
                start = min(resumed, end)
                stretch += 1
        self._add("decode", start, end, stint, self._stretch_model(t, stretch))
        return end

    @staticmethod
    def _stretch_model(t: InstanceTimings, stretch: int) -> Attributes:
        return model_attributes(t.decode_model[stretch]) if stretch < len(t.decode_model) else {}

    def _queue_and_prefill(self, stint: Stint, t: InstanceTimings) -> None:
        if t.first_scheduled is None or t.first_token is None:
            return
        self._add("queue", t.queued, t.first_scheduled, stint)
        attrs: Attributes = {
            "gen_ai.usage.input_tokens": self.record.num_prompt_tokens,
            **model_attributes(t.prefill_model),
        }
        self._add("prefill", t.first_scheduled, t.first_token, stint, attrs)

    def _handoff(self, decode: Stint, since: float, d: InstanceTimings) -> None:
        assert d.kv_ready is not None
        children = []
        attrs: Attributes = {"pdserve.handoff.transit_s": d.queued - since}
        if d.first_scheduled is not None:
            wait = Phase("kv_seat_wait", d.queued, d.first_scheduled, decode.instance_id)
            children.append(wait)
            attrs["pdserve.handoff.seat_wait_s"] = wait.seconds
        pull = d.kv_pull
        if pull is not None:
            offset = d.queued - self._raw(decode).queued  # the same clock's shift
            transfer = Phase(
                "kv_transfer", pull.started + offset, pull.ended + offset, decode.instance_id
            )
            children.append(transfer)
            attrs.update(
                {
                    "pdserve.kv.blocks": pull.num_blocks,
                    "pdserve.kv.bytes": pull.num_bytes,
                    "pdserve.kv.transport": pull.transport,
                    "pdserve.kv.transfer_s": pull.ended - pull.started,
                }
            )
        self._add("handoff", since, d.kv_ready, decode, attrs, children)

    def _seen(self, stint: Stint, name: str, since: float | None = None) -> float | None:
        """What the gateway saw of a stint its instance never reported."""
        if stint.last_arrival is None:
            return since
        start = since if since is not None else stint.first_arrival
        assert start is not None
        attrs: Attributes = {"pdserve.timing.source": "gateway"}
        return self._add(name, start, stint.last_arrival, stint, attrs)

    def _move(self, attempt: Attempt, previous_end: float | None) -> None:
        t = self._placed(attempt.first)
        end = t.queued if t is not None else attempt.dispatched
        attrs: Attributes = {
            "pdserve.move.reason": attempt.reason,
            "pdserve.move.to": attempt.first.instance_id,
            "pdserve.move.tokens_carried": attempt.tokens_carried,
            "pdserve.move.detected_at": attempt.moved_at,
        }
        self._add(attempt.move, previous_end, end, None, attrs)

    # ---- clocks -----------------------------------------------------------------------

    def _learn_after(self, stint: Stint, before: float) -> None:
        if stint.timings is not None:
            self.clocks.observe_after(stint.instance_id, stint.timings.queued, before)

    def _raw(self, stint: Stint) -> InstanceTimings:
        assert stint.timings is not None
        return stint.timings

    def _placed(self, stint: Stint) -> InstanceTimings | None:
        """The stint's timings on the gateway's clock."""
        t = stint.timings
        if t is None:
            return None
        offset = self.clocks.offset(stint.instance_id)
        if offset.error_s is not None:
            self.clock_error_s = max(self.clock_error_s, offset.error_s)
        shift = offset.seconds

        def at(stamp: float | None) -> float | None:
            return None if stamp is None else stamp + shift

        return msgspec.structs.replace(
            t,
            queued=t.queued + shift,
            first_scheduled=at(t.first_scheduled),
            kv_ready=at(t.kv_ready),
            first_token=at(t.first_token),
            last_token=at(t.last_token),
            preemptions=[(lost + shift, resumed + shift) for lost, resumed in t.preemptions],
        )

    def _add(
        self,
        name: str,
        start: float | None,
        end: float | None,
        stint: Stint | None = None,
        attributes: Attributes | None = None,
        children: list[Phase] | None = None,
    ) -> float | None:
        if start is None or end is None:
            return end
        attrs = dict(attributes or {})
        if stint is not None:
            attrs["pdserve.instance.role"] = stint.role
        instance = stint.instance_id if stint is not None else ""
        self.phases.append(Phase(name, start, end, instance, attrs, children or []))
        return end
