"""Request timelines from recorded journeys: phases on the gateway's clock (a skewed
instance clock reconciled), a migration's phase, what the gateway saw of an instance that
never reported, the bounded store, and the spans made from them."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from pdserve.common.messages import InstanceTimings, KVPullTimes, ModelTime
from pdserve.gateway.clock_sync import ClockSync
from pdserve.gateway.global_scheduler import Route
from pdserve.gateway.timeline import EXECUTE, FORWARD, Phase
from pdserve.gateway.timelines import RunFacts, RunTimeline, Timelines, TraceHeaders
from pdserve.gateway.trace_config import check_detail_modules
from pdserve.gateway.tracing import TraceExporter
from tests.gateway.instances import instance_info

T0 = 1_000_000.0
SKEW = 7.25  # the decode instance's clock runs this far ahead of the gateway's


class View:
    """What `Timelines.dispatched` reads of a route's instance."""

    def __init__(self, instance_id: str, role: str) -> None:
        self.instance_id, self.role = instance_id, role
        self.info = instance_info(instance_id, role)


def route(prefill: str | None, decode: str, decode_role: str = "decode") -> Route:
    first = View(prefill, "prefill") if prefill else None
    return Route(first, View(decode, decode_role))  # type: ignore[arg-type]


class Clock:
    """The gateway's wall clock, set by the test."""

    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch) -> Clock:
    found = Clock()
    monkeypatch.setattr("time.time", found)
    return found


def prefill_timings() -> InstanceTimings:
    return InstanceTimings(queued=T0 + 0.0015, first_scheduled=T0 + 0.012, first_token=T0 + 0.050)


def decode_timings(skew: float = SKEW) -> InstanceTimings:
    pull = KVPullTimes(T0 + 0.054 + skew, T0 + 0.058 + skew, 65536, "ucx")
    return InstanceTimings(
        queued=T0 + 0.051 + skew,
        first_scheduled=T0 + 0.053 + skew,
        kv_ready=T0 + 0.060 + skew,
        first_token=T0 + 0.070 + skew,
        last_token=T0 + 0.200 + skew,
        kv_pull=msgspec_replace(pull, num_blocks=4),
    )


def msgspec_replace(pull: KVPullTimes, **changes: int) -> KVPullTimes:
    import msgspec

    return msgspec.structs.replace(pull, **changes)


def book_with_clocks() -> Timelines:
    """A book whose clocks know D is SKEW ahead (tight bounds from both sides)."""
    timelines = Timelines("m")
    for instance, skew in (("p", 0.0), ("d", SKEW)):
        timelines.clocks.observe_output(instance, sent_at=T0 + skew, received=T0 + 0.0002)
        timelines.clocks.observe_after(instance, event=T0 + 0.0002 + skew, before=T0)
    return timelines


def run_disaggregated(timelines: Timelines, clock: Clock, request_id: str = "cmpl-1-0") -> None:
    timelines.open(request_id, T0, num_prompt_tokens=12)
    clock.t = T0 + 0.001
    timelines.dispatched(request_id, route("p", "d"))  # sent at T0 + 1 ms
    timelines.delta(request_id, "p", T0 + 0.051, prefill_timings())
    timelines.delta(request_id, "d", T0 + 0.071, None)
    timelines.delta(request_id, "d", T0 + 0.201, decode_timings())
    clock.t = T0 + 0.2015
    timelines.choice_ended(request_id, "length", 16)


def run_colocated(
    timelines: Timelines,
    clock: Clock,
    run_id: str,
    model: tuple[ModelTime, list[ModelTime]],
    preemptions: list[tuple[float, float]] | None = None,
) -> RunTimeline:
    """One choice on colocated instance "c" (its clock 0.1 ms from the gateway's): first
    token at +40 ms, last at +300 ms; `model` is the prefill's and each decode stretch's
    model time."""
    choice_id = f"{run_id}-0"
    timelines.clocks.observe_output("c", sent_at=T0, received=T0 + 0.0001)
    timelines.open(choice_id, T0, num_prompt_tokens=12)
    clock.t = T0 + 0.001
    timelines.dispatched(choice_id, route(None, "c", "colocated"))
    timings = InstanceTimings(
        queued=T0 + 0.002,
        first_scheduled=T0 + 0.003,
        first_token=T0 + 0.040,
        last_token=T0 + 0.300,
        preemptions=preemptions or [],
        prefill_model=model[0],
        decode_model=model[1],
    )
    timelines.delta(choice_id, "c", T0 + 0.301, timings)
    clock.t = T0 + 0.302
    timelines.choice_ended(choice_id, "length", 20)
    run = timelines.finish_run(RunFacts(run_id, [choice_id], {}))
    assert run is not None
    return run


def tile(phases: list[Phase], start: float, end: float, slack: float) -> None:
    ordered = sorted(phases, key=lambda p: p.start)
    assert abs(ordered[0].start - start) <= slack and abs(ordered[-1].end - end) <= slack
    for before, after in zip(ordered, ordered[1:], strict=False):
        assert abs(after.start - before.end) <= slack, (before, after)


def test_disaggregated_phases_tile_the_journey_on_the_gateways_clock(clock) -> None:
    timelines = book_with_clocks()
    run_disaggregated(timelines, clock)
    run = timelines.finish_run(RunFacts("cmpl-1", ["cmpl-1-0"], {}))
    assert run is not None
    (choice,) = run.choices
    names = [p.name for p in choice.phases]
    assert names == ["admission", "queue", "prefill", "handoff", "decode", "detokenize"]
    handoff = choice.phases[3]
    assert handoff.attributes["pdserve.kv.bytes"] == 65536
    assert handoff.attributes["pdserve.kv.blocks"] == 4
    assert handoff.attributes["pdserve.kv.transport"] == "ucx"
    transfer = next(c for c in handoff.children if c.name == "kv_transfer")
    assert transfer.start == pytest.approx(T0 + 0.054, abs=1e-3)  # the skew taken out
    assert choice.phases[4].end == pytest.approx(T0 + 0.200, abs=1e-3)
    # Gaps are transits (a millisecond here), never filled by a made-up phase.
    tile(choice.phases, T0, T0 + 0.2015, slack=0.0025)
    assert choice.e2e_s == pytest.approx(0.2015)
    assert timelines.get("cmpl-1") is run and timelines.get("cmpl-1-0") is run


def test_a_migration_is_a_phase_and_the_lost_instance_is_what_the_gateway_saw(clock) -> None:
    timelines = Timelines("m")
    for instance in ("p", "d0", "d1"):  # heartbeats: one clock, 0.1 ms away
        timelines.clocks.observe_output(instance, sent_at=T0, received=T0 + 0.0001)
    rid = "cmpl-2-0"
    timelines.open(rid, T0, num_prompt_tokens=12)
    clock.t = T0 + 0.001
    timelines.dispatched(rid, route("p", "d0"))
    timelines.delta(rid, "p", T0 + 0.051, prefill_timings())
    timelines.delta(rid, "d0", T0 + 0.080, None)
    timelines.delta(rid, "d0", T0 + 0.120, None)  # then d0 dies without reporting
    clock.t = T0 + 0.290
    timelines.dispatched(rid, route(None, "d1"), ("migration", "instance d0 failed", 5))
    alone = InstanceTimings(
        queued=T0 + 0.300, first_scheduled=T0 + 0.301, first_token=T0 + 0.340, last_token=T0 + 0.5
    )
    timelines.delta(rid, "d1", T0 + 0.501, alone)
    clock.t = T0 + 0.502
    timelines.choice_ended(rid, "length", 30)
    run = timelines.finish_run(RunFacts("cmpl-2", [rid], {}))
    assert run is not None
    phases = run.choices[0].phases
    names = [p.name for p in phases]
    assert names == [
        "admission", "queue", "prefill", "decode", "migration", "queue", "prefill", "decode",
        "detokenize",
    ]  # fmt: skip
    lost = phases[3]
    assert lost.instance == "d0" and lost.attributes["pdserve.timing.source"] == "gateway"
    assert (lost.start, lost.end) == pytest.approx((T0 + 0.050, T0 + 0.120), abs=1e-3)
    migration = phases[4]
    assert (migration.start, migration.end) == pytest.approx((T0 + 0.120, T0 + 0.300), abs=1e-3)
    assert migration.attributes["pdserve.move.tokens_carried"] == 5
    assert migration.attributes["pdserve.move.to"] == "d1"


def test_the_store_keeps_only_the_latest_runs(clock) -> None:
    observed: list[tuple[str, float]] = []
    timelines = Timelines("m", observe=lambda phase, s: observed.append((phase, s)), capacity=2)
    for n in range(3):
        run_disaggregated(timelines, clock, f"cmpl-{n}-0")
        timelines.finish_run(RunFacts(f"cmpl-{n}", [f"cmpl-{n}-0"], {}))
    assert timelines.get("cmpl-0") is None and timelines.get("cmpl-0-0") is None
    assert timelines.get("cmpl-2-0") is not None
    assert {p for p, _ in observed} >= {"queue", "prefill", "handoff", "kv_transfer", "decode"}


def test_clock_offsets_come_from_both_bounds() -> None:
    clocks = ClockSync()
    assert clocks.offset("x").error_s is None
    clocks.observe_output("x", sent_at=100.0, received=103.004)  # θ ≤ 3.004
    assert clocks.offset("x").seconds == pytest.approx(3.004)
    clocks.observe_after("x", event=10.0, before=12.996)  # θ ≥ 2.996
    offset = clocks.offset("x")
    assert offset.seconds == pytest.approx(3.0) and offset.error_s == pytest.approx(0.004)
    clocks.observe_output("x", sent_at=200.0, received=203.001)  # a tighter upper bound
    assert clocks.offset("x").error_s == pytest.approx(0.0025)


def test_spans_follow_the_clients_trace_and_the_genai_conventions(clock) -> None:
    spans = InMemorySpanExporter()
    exporter = TraceExporter(spans, detailed=True)
    timelines = book_with_clocks()
    timelines.exporter = exporter
    run_disaggregated(timelines, clock)
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = TraceHeaders(f"00-{trace_id}-{parent}-01")
    params = {"gen_ai.request.max_tokens": 16, "gen_ai.usage.output_tokens": 16}
    timelines.finish_run(RunFacts("cmpl-1", ["cmpl-1-0"], params, headers))
    exporter.shutdown()
    finished = spans.get_finished_spans()
    (root,) = [s for s in finished if s.kind == SpanKind.SERVER]
    assert f"{root.context.trace_id:032x}" == trace_id
    assert root.parent is not None and f"{root.parent.span_id:016x}" == parent
    assert root.name == "text_completion m"
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.request.max_tokens"] == 16
    assert root.attributes["gen_ai.response.finish_reasons"] == ("length",)
    children = [s for s in finished if s.parent and s.parent.span_id == root.context.span_id]
    assert sorted(s.name for s in children) == sorted(
        ["admission", "queue", "prefill", "handoff", "decode", "detokenize"]
    )
    handoff = next(s for s in children if s.name == "handoff")
    details = [s for s in finished if s.parent and s.parent.span_id == handoff.context.span_id]
    assert sorted(s.name for s in details) == ["kv_seat_wait", "kv_transfer"]


def test_without_worker_detail_the_handoff_has_no_children_and_junk_is_refused(clock) -> None:
    spans = InMemorySpanExporter()
    exporter = TraceExporter(spans)
    timelines = book_with_clocks()
    timelines.exporter = exporter
    run_disaggregated(timelines, clock)
    timelines.finish_run(RunFacts("cmpl-1", ["cmpl-1-0"], {}))
    exporter.shutdown()
    names = {s.name for s in spans.get_finished_spans()}
    assert "handoff" in names and not names & {"kv_seat_wait", "kv_transfer"}
    check_detail_modules(("model",))
    with pytest.raises(ValueError, match="^--collect-detailed-traces gpu: choose from model"):
        check_detail_modules(("model", "gpu"))
    model_only = TraceExporter.to_endpoint("http://127.0.0.1:1/v1/traces", ("model",))
    assert not model_only.detailed  # model detail adds attributes, not the worker's spans
    model_only.shutdown()


def test_a_preemption_splits_decode_into_stretches_each_with_its_model_time(clock) -> None:
    spans = InMemorySpanExporter()
    timelines = Timelines("m")
    timelines.exporter = TraceExporter(spans)
    times = (ModelTime(forward=0.02, execute=0.03), [ModelTime(0.04, 0.05), ModelTime(0.1, 0.12)])
    run = run_colocated(timelines, clock, "cmpl-3", times, [(T0 + 0.100, T0 + 0.150)])
    phases = run.choices[0].phases[3:6]
    assert [p.name for p in phases] == ["decode", "preempted", "decode"]
    bounds = [(p.start - T0, p.end - T0) for p in phases]
    expected = [(0.04, 0.1), (0.1, 0.15), (0.15, 0.3)]
    for found, wanted in zip(bounds, expected, strict=True):
        assert found == pytest.approx(wanted, abs=1e-3)
    model = [(p.attributes.get(FORWARD), p.attributes.get(EXECUTE)) for p in phases]
    assert model == [(0.04, 0.05), (None, None), (0.1, 0.12)]
    prefill = run.choices[0].phases[2]
    assert (prefill.attributes[FORWARD], prefill.attributes[EXECUTE]) == (0.02, 0.03)
    assert run.choices[0].model == {FORWARD: pytest.approx(0.16), EXECUTE: pytest.approx(0.2)}
    timelines.close()
    (root,) = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert root.attributes is not None
    assert root.attributes[FORWARD] == pytest.approx(0.16)
    assert root.attributes[EXECUTE] == pytest.approx(0.2)
    decode = [s for s in spans.get_finished_spans() if s.name == "decode"]
    assert sorted(s.attributes[EXECUTE] for s in decode if s.attributes) == [0.05, 0.12]


def test_an_untimed_forward_leaves_the_figure_out(clock) -> None:
    """A CUDA instance times execute only: no forward attribute, on the span or in sums."""
    times = (ModelTime(forward=None, execute=0.03), [ModelTime(None, 0.2)])
    run = run_colocated(Timelines("m"), clock, "cmpl-4", times)
    prefill, decode = run.choices[0].phases[2:4]
    assert prefill.attributes[EXECUTE] == 0.03 and FORWARD not in prefill.attributes
    assert decode.attributes[EXECUTE] == 0.2 and FORWARD not in decode.attributes
    assert run.choices[0].model == {EXECUTE: pytest.approx(0.23)}


def test_traces_go_over_otlp_grpc_by_default(clock, monkeypatch) -> None:
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[str] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (the generated service's name)
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    received.extend(span.name for span in scope.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
        exporter = TraceExporter.to_endpoint(f"http://127.0.0.1:{port}", ("worker",))
        timelines = book_with_clocks()
        timelines.exporter = exporter
        run_disaggregated(timelines, clock)
        timelines.finish_run(RunFacts("cmpl-1", ["cmpl-1-0"], {}))
        monkeypatch.undo()  # gRPC's deadlines need the real clock
        timelines.close()  # exports what is queued
    finally:
        server.stop(None)
    assert "text_completion m" in received and "kv_transfer" in received
