"""What a request's timeline costs the gateway's event loop, without sockets: recording each
delta, and a request's end (phases, store, histogram) without and with tracing (spans
queued to the SDK's batch processor, an in-memory exporter behind it).

    PYTHONPATH=. python -m experiments.timeline_cost
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.common.messages import InstanceTimings, KVPullTimes
from pdserve.gateway.global_scheduler import Route
from pdserve.gateway.timelines import RunFacts, Timelines, TraceHeaders
from pdserve.gateway.tracing import TraceExporter

REQUESTS = 2000
TOKENS = 128
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@dataclass
class View:
    instance_id: str
    role: str


ROUTE = Route(View("prefill-0", "prefill"), View("decode-0", "decode"))  # type: ignore[arg-type]


def record(timelines: Timelines, index: int, now: float) -> str:
    """One disaggregated request's journey: P's first token, then D's tokens."""
    rid = f"cmpl-{index}-0"
    timelines.open(rid, now, 256)
    timelines.dispatched(rid, ROUTE)
    prefill = InstanceTimings(
        queued=now + 0.001, first_scheduled=now + 0.002, first_token=now + 0.05
    )
    pull = KVPullTimes(now + 0.053, now + 0.058, 368640, "ucx", 1)
    decode = InstanceTimings(
        queued=now + 0.051, first_scheduled=now + 0.052, kv_ready=now + 0.06,
        first_token=now + 0.07, last_token=now + 0.5, kv_pull=pull,
    )  # fmt: skip
    timelines.delta(rid, "prefill-0", now + 0.051, prefill)
    for k in range(TOKENS - 2):
        timelines.delta(rid, "decode-0", now + 0.07 + k * 0.003, None)
    timelines.delta(rid, "decode-0", now + 0.501, decode)
    timelines.choice_ended(rid, "length", TOKENS)
    return rid


def measure(exporter: TraceExporter | None) -> tuple[float, float]:
    """Medians: µs per recorded delta, µs per request's end."""
    timelines = Timelines("m", observe=lambda phase, seconds: None)
    timelines.exporter = exporter
    per_delta, per_end = [], []
    for index in range(REQUESTS):
        began = time.perf_counter()
        rid = record(timelines, index, time.time())
        recorded = time.perf_counter()
        facts = RunFacts(f"cmpl-{index}", [rid], {"gen_ai.request.max_tokens": TOKENS})
        timelines.finish_run(facts if exporter is None else _traced(facts))
        per_delta.append((recorded - began) / TOKENS)
        per_end.append(time.perf_counter() - recorded)
    return statistics.median(per_delta) * 1e6, statistics.median(per_end) * 1e6


def _traced(facts: RunFacts) -> RunFacts:
    return RunFacts(facts.run_id, facts.choice_ids, facts.params, TraceHeaders(TRACEPARENT))


def main() -> None:
    delta, end = measure(None)
    print(f"timeline only: {delta:.2f} us per delta, {end:.1f} us per request's end")
    exporter = TraceExporter(InMemorySpanExporter(), detailed=True)
    delta, end = measure(exporter)
    print(f"with tracing:  {delta:.2f} us per delta, {end:.1f} us per request's end")
    exporter.shutdown()


if __name__ == "__main__":
    main()
